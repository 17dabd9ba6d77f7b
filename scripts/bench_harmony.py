"""Benchmark the harmony parser (io/api/harmony) on gpt-oss-shaped output: tokens/s parsed.

An output is an analysis message, a tool call and a final answer, as ids of the built-in tiny
model's tokenizer (bytes plus the harmony special tokens), repeated to `--tokens` tokens.
Reports the whole parse (a plain answer) and a stream fed `--step` tokens at a time (what a
streamed chat costs per sample), CPU time, best of `--repeat`.

    python scripts/bench_harmony.py [--tokens 20000] [--step 1] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from decode_worker.device.default_model import EOS_TOKEN_IDS, byte_tokenizer
from decode_worker.device.tokenizer import Tokenizer
from decode_worker.io.api.harmony import HarmonyParser, HarmonyTokens, parse

TURN = ("<|channel|>analysis<|message|>The user wants the weather in Paris; I should call the "
        "tool and then answer briefly.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
        "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris, 22 °C.<|end|>"
        "<|start|>assistant")


def best_of(repeat: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(repeat):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=20_000)
    ap.add_argument("--step", type=int, default=1, help="tokens per streamed push")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    tok = Tokenizer(byte_tokenizer(), EOS_TOKEN_IDS)
    tokens = HarmonyTokens.of(tok)
    assert tokens is not None
    turn = tok.encode(TURN)
    ids = (turn * (args.tokens // len(turn) + 1))[: args.tokens]

    def stream() -> None:
        parser = HarmonyParser(tokens, tok)
        for i in range(0, len(ids), args.step):
            parser.push(ids[i : i + args.step])
        parser.finish()

    whole_s = best_of(args.repeat, lambda: parse(ids, tokens, tok))
    stream_s = best_of(args.repeat, stream)
    calls = len(parse(ids, tokens, tok).calls)
    print(f"harmony parser: {len(ids)} tokens, {calls} tool calls")
    print(f"  whole parse:          {len(ids) / whole_s:12,.0f} tokens/s")
    print(f"  stream, {args.step} token(s)/push: {len(ids) / stream_s:12,.0f} tokens/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
