"""README.md and docs/DEPLOY.md match the CLI: every `--flag` they attribute to a subcommand is
one that subcommand's parser (`cli.build_parser()`, what `--help` prints) accepts.

What counts as attributed:
- a command line, in a code span or a fenced block (`\\` continuations joined), that runs
  `decode-worker SUB` or `python[3] -m decode_worker SUB`: every flag after SUB (up to a `#`
  comment) is SUB's;
- prose: in a paragraph (or list item, or table row) that names a subcommand (`decode-worker SUB`
  in code, or `SUB` alone in code), a flag in code after a mention belongs to the subcommands
  named last (`for `prefill` and `demo``: both); a flag before any mention belongs to every
  server subcommand (the README's "each server takes ..."). Paragraphs that name no subcommand
  are about other programs (SGLang, the router, docker) and are not checked.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from decode_worker.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = (ROOT / "README.md", ROOT / "docs" / "DEPLOY.md")
SERVERS = ("serve", "prefill", "demo")
_FLAG = re.compile(r"--[a-z][a-z0-9-]*")
_CODE = re.compile(r"`([^`]+)`")
_INVOKE = re.compile(r"(?:decode-worker|python3? -m decode_worker)\s+([a-z][a-z-]*)(.*)")


def subcommand_flags() -> dict[str, set[str]]:
    """Subcommand -> the option strings its parser accepts."""
    out: dict[str, set[str]] = {}
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[name] = {o for a in sub._actions for o in a.option_strings}
    return out


def _command_claims(line: str, known: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(subcommand, flag) for a command line that runs decode-worker, else []."""
    match = _INVOKE.search(line)
    if match is None or match.group(1) not in known:
        return []
    rest = match.group(2).split(" #", 1)[0]
    return [(match.group(1), flag) for flag in _FLAG.findall(rest)]


def _fenced_lines(text: str) -> tuple[list[str], str]:
    """The fenced code lines (continuations joined) and the prose with the fences removed."""
    code: list[str] = []
    prose: list[str] = []
    inside, pending = False, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
            prose.append("")
            continue
        if not inside:
            prose.append(line)
            continue
        pending += line.rstrip("\\").rstrip() + " "
        if not line.rstrip().endswith("\\"):
            code.append(pending)
            pending = ""
    return code, "\n".join(prose)


def _paragraphs(prose: str) -> list[str]:
    """Blocks split at blank lines, list items and table rows."""
    blocks = re.split(r"\n\s*\n|\n(?=\s*(?:[-*] |\|))", prose)
    return [" ".join(b.split()) for b in blocks if b.strip()]


def _mention(span: str, known: dict[str, set[str]]) -> str | None:
    """The subcommand a code span names (`decode-worker SUB ...` or `SUB`), else None."""
    match = _INVOKE.search(span)
    name = match.group(1) if match is not None else span.strip()
    return name if name in known else None


def _prose_claims(block: str, known: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Flags in code spans, attributed to the subcommands named last (mentions joined by
    "and" or a comma count together); before any mention, to every server subcommand."""
    claims: list[tuple[str, str]] = []
    current: tuple[str, ...] = SERVERS
    named, prev_end, prev_mention = False, 0, False
    for match in _CODE.finditer(block):
        span = match.group(1)
        joined = prev_mention and block[prev_end:match.start()].strip(" ,") in ("", "and", "or")
        prev_end = match.end()
        name = _mention(span, known)
        claims += _command_claims(span, known)
        if name is not None:
            current = (*current, name) if joined else (name,)
            named, prev_mention = True, True
            continue
        prev_mention = False
        flag = _FLAG.match(span)
        if flag is not None:
            claims += [(sub, flag.group(0)) for sub in current]
    return claims if named else []


def doc_claims(text: str, known: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every (subcommand, flag) the text attributes (see the module docstring)."""
    code, prose = _fenced_lines(text)
    claims = [c for line in code for c in _command_claims(line, known)]
    for block in _paragraphs(prose):
        claims += _prose_claims(block, known)
    return claims


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_flag_the_docs_attribute_to_a_subcommand_exists(doc: Path) -> None:
    known = subcommand_flags()
    claims = doc_claims(doc.read_text(), known)
    wrong = sorted({(s, f) for s, f in claims if f not in known[s]})
    assert not wrong, f"{doc.name}: flags the CLI does not have: {wrong}"


def test_the_readme_claims_are_found() -> None:
    """The check sees the README's flags (a parser that finds nothing would pass anything)."""
    claims = set(doc_claims((ROOT / "README.md").read_text(), subcommand_flags()))
    assert {("prefill", "--bootstrap-port"), ("prefill", "--protocol"), ("demo", "--port"),
            ("serve", "--model")} <= claims


def test_a_flag_the_cli_lacks_is_caught() -> None:
    known = subcommand_flags()
    text = "Run `decode-worker serve --bootstrap-port 9` or\n\n```\ndecode-worker demo \\\n" \
           "  --turns 3 --nope\n```\n\nand `decode-worker config` takes `--json`.\n"
    claims = doc_claims(text, known)
    wrong = {(s, f) for s, f in claims if f not in known[s]}
    assert wrong == {("serve", "--bootstrap-port"), ("demo", "--nope")}
    assert ("config", "--json") in claims
