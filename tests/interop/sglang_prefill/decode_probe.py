"""SGLang 0.5.23's own decode side, driven line by line by a test in another environment.

    .venv-sglang/bin/python tests/interop/sglang_prefill/decode_probe.py \
        --bootstrap-addr 127.0.0.1:18401 --own-port 18403 --dump-dir DIR [layout flags]

Runs `decode_side.DecodeSide` (SGLang's `NixlKVManager(DECODE)`, one `NixlKVReceiver` per
room) against the prefill whose bootstrap server is at `--bootstrap-addr`, and answers JSON
commands read from stdin, one per line, with one stdout line `PROBE {json}` each (NIXL's own
INFO lines also go to stdout). Used by tests/integration/test_prefill_sglang.py, which checks
our `decode-worker prefill --protocol sglang` against SGLang's decode.

Every K/V pool element starts as SENTINEL and pages are never reused, so a dump also shows what
was *not* written. Commands:

    {"op": "receive", "room", "seq_len", "prefix_len": 0, "swa_page_delta": 0}
        -> {"row"}: pages allocated, TransferInfo sent (`send_metadata`)
    {"op": "wait", "room", "timeout_s": 60}
        -> {"status": success|failed|timeout, "reason", "elapsed_s", "aux", "dump"}:
           `dump` is an .npz with, per model layer, `k<layer>` / `v<layer>` = the pool rows of
           positions [0, L) (full layers) or [swa_start, L) (sliding layers), and `swa_start`
    {"op": "abort", "room", "timeout_s": 10}
        -> {"acked", "elapsed_s"}: `NixlKVReceiver.abort()`, then until the prefill's
           ABORT_ACK is recorded (`is_abort_release_safe`)
    {"op": "quit"}
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import sglang_cpu
from layout import add_layout_args, layout_from_args

sglang_cpu.prepare_env()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from decode_side import DecodeSide, Receipt  # noqa: E402

SENTINEL = 12345.0


def reply(obj: dict[str, Any]) -> None:
    sys.stdout.write("PROBE " + json.dumps(obj) + "\n")
    sys.stdout.flush()


class Probe:
    def __init__(self, decode: DecodeSide, dump_dir: Path) -> None:
        self.decode, self.dump_dir = decode, dump_dir
        self.receipts: dict[int, Receipt] = {}
        for layer in range(decode.layout.num_layers):
            decode.pool.get_key_buffer(layer).fill_(SENTINEL)
            decode.pool.get_value_buffer(layer).fill_(SENTINEL)

    def receive(self, cmd: dict[str, Any]) -> dict[str, Any]:
        receipt = self.decode.receive(cmd["room"], cmd["seq_len"], cmd.get("prefix_len", 0),
                                      cmd.get("swa_page_delta", 0))
        self.receipts[cmd["room"]] = receipt
        return {"row": receipt.row, "num_swa_pages": len(receipt.swa_pages)}

    def wait(self, cmd: dict[str, Any]) -> dict[str, Any]:
        receipt = self.decode.wait(self.receipts[cmd["room"]], cmd.get("timeout_s", 60.0))
        out: dict[str, Any] = {"status": receipt.status, "reason": receipt.reason,
                               "elapsed_s": receipt.times["done"] - receipt.times["sent"]}
        if receipt.status == "success":
            out["aux"] = self.decode.aux_row(receipt)
        out["dump"] = str(self.dump(receipt))
        return out

    def dump(self, receipt: Receipt) -> Path:
        lay, ps = self.decode.layout, self.decode.layout.page_size
        arrays: dict[str, np.ndarray] = {"swa_start": np.array(receipt.swa_start)}
        for layer in range(lay.num_layers):
            if layer in lay.sliding_layer_ids:
                positions = np.arange(receipt.swa_start, receipt.seq_len)
                # (int64: a full hit's window and page list are empty)
                pages = np.array(receipt.swa_pages, np.int64)[(positions - receipt.swa_start)
                                                              // ps]
            else:
                positions = np.arange(0, receipt.seq_len)
                pages = np.array(receipt.full_pages, np.int64)[positions // ps]
            slots = torch.from_numpy(pages * ps + positions % ps)
            arrays[f"k{layer}"] = self.decode.pool.get_key_buffer(layer)[slots].numpy()
            arrays[f"v{layer}"] = self.decode.pool.get_value_buffer(layer)[slots].numpy()
        path = self.dump_dir / f"room-{receipt.room}.npz"
        np.savez(path, **arrays)
        return path

    def abort(self, cmd: dict[str, Any]) -> dict[str, Any]:
        room, start = cmd["room"], time.monotonic()
        self.receipts[room].receiver.abort()
        deadline = start + cmd.get("timeout_s", 10.0)
        acked = False
        while time.monotonic() < deadline:
            if self.decode.manager.is_abort_release_safe(room, 1):
                acked = True
                break
            time.sleep(0.005)
        return {"acked": acked, "elapsed_s": time.monotonic() - start}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bootstrap-addr", required=True)
    ap.add_argument("--own-port", type=int, required=True)
    ap.add_argument("--dump-dir", type=Path, required=True)
    add_layout_args(ap)
    args = ap.parse_args()
    start = time.monotonic()
    decode = DecodeSide(layout_from_args(args), args.bootstrap_addr, args.own_port)
    decode.connect(timeout_s=120.0)
    probe = Probe(decode, args.dump_dir)
    reply({"event": "ready", "startup_s": time.monotonic() - start})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        try:
            reply({"ok": True, **getattr(probe, cmd["op"])(cmd)})
        except Exception as exc:  # report to the driving test, keep serving
            reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    sys.stdout.flush()
    os._exit(0)  # SGLang's transfer threads are not daemon threads


if __name__ == "__main__":
    raise SystemExit(main())
