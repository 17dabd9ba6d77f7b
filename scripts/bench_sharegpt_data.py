"""A ShareGPT-format data set made here, for `sglang.bench_serving --dataset-name sharegpt`
(scripts/bench_serving.sh): nothing can be downloaded, so seeded random multi-turn conversations
stand in for ShareGPT_V3_unfiltered_cleaned_split.json.

    python -m scripts.bench_sharegpt_data --out FILE [--conversations 200] [--seed 0]

Each record is `{"id": ..., "conversations": [{"from": "human"|"gpt", "value": text}, ...]}`
with 1 to 4 exchanges, the shape bench_serving reads (it takes each record's first exchange).
Words come from a fixed English word list, so every tokenizer encodes them; the same seed gives
the same file.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

_WORD_TEXT = (
    "the a of to and in is it you that he was for on are with as his they be at one have this "
    "from or had by word but what some we can out other were all there when up use your how said "
    "an each she which do their time if will way about many then them write would like so these "
    "her long make thing see him two has look more day could go come did number sound no most "
    "people my over know water than call first who may down side been now find any new work part "
    "take get place made live where after back little only round man year came show every good "
    "me give our under name very through just form sentence great think say help low line differ "
    "turn cause much mean before move right boy old too same tell does set three want air well "
    "also play small end put home read hand port large spell add even land here must big high "
    "such follow act why ask men change went light kind off need house picture try us again "
    "animal point mother world near build self earth father head stand own page should country"
)
WORDS = tuple(_WORD_TEXT.split())
QUESTION_STARTS = ("How do I", "Why does", "Explain how", "Write a short note on", "What is",
                   "Can you list", "Summarise")


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]
    return " ".join(words).capitalize() + "."


def _turn(rng: random.Random, human: bool) -> str:
    if human:
        head = rng.choice(QUESTION_STARTS)
        return f"{head} {_sentence(rng, 6, 40).rstrip('.').lower()}?"
    return " ".join(_sentence(rng, 4, 14) for _ in range(rng.randint(1, 4)))


def conversations(num: int, seed: int) -> list[dict[str, Any]]:
    """`num` records, each with 1..4 human/gpt exchanges; deterministic in `seed`."""
    rng = random.Random(seed)
    out = []
    for i in range(num):
        turns = []
        for _ in range(rng.randint(1, 4)):
            turns.append({"from": "human", "value": _turn(rng, True)})
            turns.append({"from": "gpt", "value": _turn(rng, False)})
        out.append({"id": f"local-{seed}-{i}", "conversations": turns})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.conversations < 1:
        ap.error("--conversations must be at least 1")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(conversations(args.conversations, args.seed), indent=1))
    print(f"wrote {args.conversations} conversations to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
