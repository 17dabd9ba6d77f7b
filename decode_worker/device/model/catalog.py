"""`decode-worker models`: the supported families, what each reads from config.json, and which
prefill protocols and kernel backends serve it."""

from __future__ import annotations

import argparse
import json
import textwrap
from typing import Any

from decode_worker.device.model.families.common import Family
from decode_worker.device.model.registry import FAMILIES

COLUMNS = ("family", "architectures (model_type)", "KV layout", "prefill protocols",
           "decode backends", "example")


def describe(family: Family) -> dict[str, Any]:
    """One family's row (the JSON form of `decode-worker models --json`)."""
    return {"family": family.name, "architectures": list(family.architectures),
            "model_types": list(family.model_types), "kv_layout": family.kv_layout,
            "prefill_protocols": list(family.protocols), "backends": list(family.backends),
            "reads": list(family.reads), "example": family.example}


def table() -> str:
    """The families as a text table, then what each reads."""
    rows = [(f.name, f"{', '.join(f.architectures)} ({', '.join(f.model_types)})",
             f.kv_layout, ", ".join(f.protocols), ", ".join(f.backends), f.example)
            for f in FAMILIES]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths, strict=True)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
              for r in rows]
    lines.append("")
    for f in FAMILIES:
        lines += textwrap.wrap(f"{f.name} reads: {', '.join(f.reads)}", 100,
                               subsequent_indent="    ")
    return "\n".join(lines)


def run(args: argparse.Namespace, loaded: object) -> int:
    """Print the table (or `--json`: one object per family)."""
    if getattr(args, "json", False):
        print(json.dumps([describe(f) for f in FAMILIES], indent=2))
    else:
        print(table())
    return 0
