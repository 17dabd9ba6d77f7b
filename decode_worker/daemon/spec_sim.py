"""`decode-worker spec-sim TRACE.jsonl`: what speculative decoding would earn on a trace.

Replays the trace through the drafters the server runs (core/spec), in file order, with one
drafter per algorithm, so later records find earlier ones in the shared memory as they would
on the worker (core/spec/replay.py says how a record is replayed). A record is one JSON object
per line: `{"id", "conversation", "prompt", "response"}`; prompt and response are text or
lists of token ids. Text is tokenized with gpt-oss's o200k_harmony encoding (offline: the
vocabulary of the `quicktok-v1` package, special tokens such as `<|start|>` read as such) or,
with `--model DIR`, with that model's tokenizer.json.

The algorithm and K come from the settings (`--speculative-algorithm`,
`--speculative-num-draft-tokens` and the knobs, as `serve` takes them); with no algorithm
configured both NGRAM and SUFFIX run, one table row each, and the last line is SUFFIX's. The
last line is exactly:

    spec-sim: records=N output_tokens=T verify_steps=S accept_length=A proposed=P accepted=C
    efficiency=E draft_us_per_step=D

(one line: accept_length = T / S, the bonus token included; efficiency = C / P;
draft_us_per_step: drafting CPU time per verify step: propose, accept and the per-step
flush.)
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from decode_worker.core.spec import make_drafter
from decode_worker.core.spec.replay import ReplayStats, replay
from decode_worker.errors import ConfigError
from decode_worker.settings import LoadedSettings, SpeculativeSettings

Encode = Callable[[str], list[int]]


@dataclass(frozen=True, slots=True)
class Record:
    id: str
    conversation: str
    prompt: list[int]
    response: list[int]


def run(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    spec = loaded.settings.speculative
    records = load_trace(args.trace, _encoder(loaded.settings.model.path))
    algorithms = [spec.algorithm] if spec.enabled else ["NGRAM", "SUFFIX"]
    rows = [(name, *simulate(records, spec.model_copy(update={"algorithm": name})))
            for name in algorithms]
    print(f"spec-sim: {args.trace} ({len(records)} records, "
          f"{sum(len(r.prompt) for r in records)} prompt tokens)")
    print(f"{'algorithm':<10} {'K':>3} {'output':>9} {'verify':>8} {'accept_len':>10} "
          f"{'proposed':>9} {'accepted':>9} {'efficiency':>10} {'us/step':>8} {'critical':>8} "
          f"{'ms/req':>7}")
    for name, k, s in rows:
        ms_per_req = s.start_finish_s / max(s.records, 1) * 1e3
        print(f"{name:<10} {k:>3} {s.output_tokens:>9} {s.verify_steps:>8} "
              f"{s.accept_length:>10.3f} {s.proposed:>9} {s.accepted:>9} {s.efficiency:>10.3f} "
              f"{s.draft_us_per_step:>8.1f} {s.critical_us_per_step:>8.1f} {ms_per_req:>7.2f}")
    print("(CPU time. us/step: drafting per verify step, of which critical: propose + accept, "
          "the rest flush; ms/req: start + finish per request, indexing the prompt and "
          "storing)")
    print(last_line(rows[-1][2]))
    return 0


def simulate(records: list[Record], spec: SpeculativeSettings) -> tuple[int, ReplayStats]:
    """(K, totals) of one algorithm over the whole trace, in order."""
    params = spec.params()
    if params is None:
        raise ConfigError("spec-sim: no speculative algorithm to simulate")
    drafter = make_drafter(params)
    total = ReplayStats()
    for i, rec in enumerate(records):
        total.add(replay(drafter, f"{i}:{rec.id}", rec.prompt, rec.response,
                         params.num_draft_tokens))
    return params.num_draft_tokens, total


def last_line(s: ReplayStats) -> str:
    return (f"spec-sim: records={s.records} output_tokens={s.output_tokens} "
            f"verify_steps={s.verify_steps} accept_length={s.accept_length:.3f} "
            f"proposed={s.proposed} accepted={s.accepted} efficiency={s.efficiency:.3f} "
            f"draft_us_per_step={s.draft_us_per_step:.1f}")


def load_trace(path: Path, encode: Encode) -> list[Record]:
    """Read and tokenize a trace; raises ConfigError naming the line of a bad record."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    records = []
    with path.open() as lines:
        for lineno, line in enumerate(lines, 1):
            if line.strip():
                records.append(_record(line, lineno, path, encode))
    return records


def _record(line: str, lineno: int, path: Path, encode: Encode) -> Record:
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected an object with prompt and response")
    rid = str(obj.get("id", lineno))
    conversation = str(obj.get("conversation", rid))
    return Record(rid, conversation, _tokens(obj, "prompt", where, encode),
                  _tokens(obj, "response", where, encode))


def _tokens(obj: dict[str, Any], key: str, where: str, encode: Encode) -> list[int]:
    value = obj.get(key)
    if isinstance(value, str):
        return encode(value)
    if isinstance(value, list) and all(isinstance(t, int) and t >= 0 for t in value):
        return value
    raise ConfigError(f"{where}: {key!r} must be text or a list of token ids >= 0")


def _encoder(model_dir: Path | None) -> Encode:
    """Text -> ids: the model's tokenizer, or o200k_harmony (loaded on first use)."""
    if model_dir is not None:
        from decode_worker.device.tokenizer import Tokenizer

        return Tokenizer.from_dir(model_dir).encode
    state: dict[str, Encode] = {}

    def encode(text: str) -> list[int]:
        if "encode" not in state:
            state["encode"] = _o200k()
        return state["encode"](text)

    return encode


def _o200k() -> Encode:
    try:
        import quicktok  # type: ignore[import-untyped]
    except ImportError:
        raise ConfigError("text records need gpt-oss's o200k tokenizer (pip install "
                          "quicktok-v1) or --model DIR; token-id records need neither") from None
    enc = quicktok.get_encoding("o200k_harmony")

    def encode(text: str) -> list[int]:
        return list(enc.encode(text, allowed_special="all"))

    return encode
