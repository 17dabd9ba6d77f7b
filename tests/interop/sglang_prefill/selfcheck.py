"""End-to-end check of the rig inside the SGLang venv: SGLang prefill -> SGLang decode.

    .venv-sglang/bin/python tests/interop/sglang_prefill/selfcheck.py [--tp-size 2]

Starts prefill_server.py (SGLang's prefill classes, synthetic KV), plays SGLang's own decode
side in this process (decode_side.py), and checks, room by room: KV bytes landed in the decode
pools equal `kv_bits` (full layers from the decode prefix, SWA layers over SGLang's window),
the metadata row (first token, logprobs, bootstrap_room), that failures the prefill reports
reach the decode as KV_STATUS Failed with SGLang's reason, and that a silent prefill-side abort
and a dying prefill are caught by SGLang's decode (waiting timeout, /health heartbeat). Prints
`selfcheck: N passed, M failed`; exits non-zero if any check fails. With `--model DIR` (a Hugging
Face gpt-oss directory, e.g. `decode-worker make-model DIR`) the pools take the model's geometry
and a first room checks `kv: model`: the landed KV is transformers' own K/V of the prompt.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import sglang_cpu
from layout import add_layout_args, layout_from_args

sglang_cpu.prepare_env()

import launch  # noqa: E402
import requests  # noqa: E402
from decode_side import DecodeSide, ExpectedKV, Receipt  # noqa: E402

Check = Callable[[DecodeSide, int, int], list[str]]


def _expect_success(decode: DecodeSide, receipt: Receipt, seed: int,
                    aux: dict[str, Any] | None = None,
                    expected: ExpectedKV | None = None) -> list[str]:
    if receipt.status != "success":
        return [f"room {receipt.room}: {receipt.status} ({receipt.reason})"]
    problems = decode.mismatches(receipt, seed, expected)
    got = decode.aux_row(receipt)
    if got["bootstrap_room"] != receipt.room:
        problems.append(f"aux bootstrap_room {got['bootstrap_room']} != {receipt.room}")
    for key, want in (aux or {}).items():
        if got[key] != want:
            problems.append(f"aux {key}: {got[key]!r} != {want!r}")
    return problems


def room_chunked_with_logprobs(decode: DecodeSide, ctl: int, seed: int) -> list[str]:
    """Decode publishes first; 300 tokens in 128-token chunks; logprobs in the aux row."""
    receipt = decode.receive(1001, 300)
    top = [[42, -0.5], [7, -1.25], [9, -3.0]]
    launch.post(ctl, "/prefill", {"room": 1001, "input_ids": list(range(300)),
                                  "chunk_tokens": 128, "first_token": 42, "logprob": -0.5,
                                  "top_logprobs": top, "seed": seed, "wait_s": 30})
    decode.wait(receipt, 30)
    aux = {"first_token": 42, "logprob": -0.5, "logprob_idx": 42,
           "top_logprobs_val": [-0.5, -1.25, -3.0] + [0.0] * 125,
           "top_logprobs_idx": [42, 7, 9] + [0] * 125}
    problems = _expect_success(decode, receipt, seed, aux)
    decode.release(receipt)
    return problems


def room_decode_prefix(decode: DecodeSide, ctl: int, seed: int) -> list[str]:
    """Prefill request first; decode radix hit of 64 tokens (decode_prefix_len=64)."""
    launch.post(ctl, "/prefill", {"room": 1002, "input_ids": list(range(1, 201)),
                                  "chunk_tokens": 64, "first_token": 5, "seed": seed + 1})
    receipt = decode.wait(decode.receive(1002, 200, prefix_len=64), 30)
    problems = _expect_success(decode, receipt, seed + 1, {"first_token": 5})
    state = launch.get(ctl, "/rooms/1002")
    prefixes = {r["decode_prefix_len"] for r in state["ranks"]}
    if prefixes != {64}:
        problems.append(f"prefill saw decode_prefix_len {prefixes}, want 64")
    decode.release(receipt)
    return problems


def room_state_mismatch(decode: DecodeSide, ctl: int, seed: int) -> list[str]:
    """The prefill sends one SWA page more than asked: SGLang's worker fails the room.

    SGLang words it "State index length mismatch" with equal TP and "Head-sliced PD transfer
    page count mismatch" when the prefill's TP differs.
    """
    receipt = decode.receive(1003, 180)
    launch.post(ctl, "/prefill", {"room": 1003, "input_ids": list(range(180)),
                                  "fail": "state_mismatch", "wait_s": 30})
    decode.wait(receipt, 30)
    decode.release(receipt)
    asked = len(receipt.swa_pages)
    if receipt.status != "failed" or not re.search(
            rf"mismatch.*prefill={asked + 1}, d(st|ecode)={asked}\b", receipt.reason or ""):
        return [f"room 1003: want a state-mismatch failure, got {receipt.status} "
                f"({receipt.reason})"]
    return []


def room_status_failure(decode: DecodeSide, ctl: int, seed: int) -> list[str]:
    """The prefill concludes the room Failed (as on a transport error) with a reason."""
    receipt = decode.receive(1004, 50)
    launch.post(ctl, "/prefill", {"room": 1004, "input_ids": list(range(50)), "fail": "status",
                                  "fail_reason": "synthetic failure of room 1004", "wait_s": 30})
    decode.wait(receipt, 30)
    decode.release(receipt)
    if receipt.status != "failed" or "synthetic failure of room 1004" not in (receipt.reason or ""):
        return [f"room 1004: want the prefill's reason, got {receipt.status} ({receipt.reason})"]
    return []


def room_prefill_aborts_silently(decode: DecodeSide, ctl: int, seed: int) -> list[str]:
    """A prefill-side abort tells the decode nothing: only its waiting timeout fails it."""
    receipt = decode.receive(1006, 50)
    launch.post(ctl, "/prefill", {"room": 1006, "input_ids": list(range(50)), "fail": "abort",
                                  "wait_s": 10})
    decode.wait(receipt, 30)
    decode.release(receipt)
    if receipt.status != "failed" or "WaitingForInput" not in (receipt.reason or ""):
        return [f"room 1006: want the decode's waiting timeout, got {receipt.status} "
                f"({receipt.reason})"]
    return []


def room_prefill_dies(decode: DecodeSide, ctl: int, seed: int) -> list[str]:
    """Last: the prefill process exits mid-room; SGLang's decode heartbeat fails the room."""
    receipt = decode.receive(1005, 50)
    with contextlib.suppress(requests.RequestException):
        launch.post(ctl, "/prefill", {"room": 1005, "input_ids": list(range(50)),
                                      "fail": "die"}, timeout_s=5)
    decode.wait(receipt, 30)
    if receipt.status != "failed" or "Lost connection" not in (receipt.reason or ""):
        return [f"room 1005: want a lost-connection failure, got {receipt.status} "
                f"({receipt.reason})"]
    return []


def room_model_kv(model_dir: str) -> Check:
    """`kv: model`: the landed KV is transformers' own post-RoPE K/V of the prompt (full layers
    from a 32-token decode prefix, SWA over the window), the aux row its greedy first token,
    logprob and top-3 logprobs (float32 log_softmax of the raw logits)."""

    def check(decode: DecodeSide, ctl: int, seed: int) -> list[str]:
        import torch
        from forward import ModelForward, model_aux

        ids = [(7 * i + 3) % 250 for i in range(230)]
        receipt = decode.receive(1007, len(ids), prefix_len=32)
        spec = {"room": 1007, "input_ids": ids, "kv": "model", "chunk_tokens": 96,
                "return_logprob": True, "top_logprobs_num": 3, "wait_s": 30}
        launch.post(ctl, "/prefill", spec)
        decode.wait(receipt, 30)
        result = ModelForward(model_dir, decode.layout).run(ids)
        want = model_aux(result, spec)
        tops = [t for t, _ in want["top_logprobs"]]
        aux = {"first_token": want["first_token"], "logprob": want["logprob"],
               "logprob_idx": want["first_token"], "top_logprobs_idx": tops + [0] * 125,
               "top_logprobs_val": [v for _, v in want["top_logprobs"]] + [0.0] * 125}

        def expected(layer: int, kind: int, positions: Any) -> Any:
            rows = torch.from_numpy(positions)
            return (result.values if kind else result.keys)[layer][rows]

        problems = _expect_success(decode, receipt, seed, aux, expected)
        decode.release(receipt)
        return problems

    check.__name__ = "room_model_kv"
    return check


CHECKS: list[Check] = [room_chunked_with_logprobs, room_decode_prefix, room_state_mismatch,
                       room_status_failure, room_prefill_aborts_silently, room_prefill_dies]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap-port", type=int, default=18210)
    parser.add_argument("--control-port", type=int, default=18211)
    parser.add_argument("--decode-port", type=int, default=18212,
                        help="the decode ServerArgs' own bootstrap port (never bound)")
    parser.add_argument("--tp-in-process", action="store_true")
    parser.add_argument("--seed", type=int, default=3)
    add_layout_args(parser)
    args = parser.parse_args()
    layout = layout_from_args(args)
    # SGLang's decode polls the prefill's /health; its floor is 2 s, 2 misses fail the rooms
    os.environ.setdefault("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", "2")
    # a room the prefill drops silently fails here after this long (SGLang's default: 300 s)
    os.environ.setdefault("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "4")
    extra = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
             if k in ("num_layers", "sliding_layers", "kv_heads", "head_dim", "dtype",
                      "page_size", "sliding_window", "tp_size", "pool_tokens",
                      "swa_pool_tokens", "metadata_rows", "model") and v is not None]
    extra += ["--tp-in-process"] if args.tp_in_process else []
    t0 = time.monotonic()
    server, ready = launch.start_prefill_server(args.bootstrap_port, args.control_port, extra)
    passed = failed = 0
    try:
        print(f"prefill ready in {time.monotonic() - t0:.1f}s: tp={layout.tp_size} "
              f"rank ports {[r['rank_port'] for r in ready['ranks']]}", flush=True)
        # the decode runs with attention TP 1: it holds every KV head
        decode = DecodeSide(replace(layout, tp_size=1), f"127.0.0.1:{args.bootstrap_port}",
                            args.decode_port)
        decode.connect()
        checks = [room_model_kv(args.model), *CHECKS] if args.model else CHECKS
        for check in checks:
            t = time.monotonic()
            problems = check(decode, args.control_port, args.seed)
            verdict = "ok" if not problems else "FAILED: " + "; ".join(problems)
            print(f"{check.__name__}: {verdict} ({time.monotonic() - t:.2f}s)", flush=True)
            passed, failed = passed + (not problems), failed + bool(problems)
    finally:
        launch.stop(server)
    print(f"selfcheck: {passed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # SGLang's decode threads are not daemon threads
