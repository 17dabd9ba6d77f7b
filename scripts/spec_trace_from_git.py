"""Build a code-editing trace for `decode-worker spec-sim` from any git repository's history.

Each record is one file of one real commit, as an agent that rewrites whole files would see it:

    {"id": "<commit>:<path>", "conversation": "<commit>",
     "prompt": "<instruction naming the file and the commit message>\\n\\n<the file before>",
     "response": "<the file after>"}

Commits are taken oldest first (the last `--max-commits` non-merge commits of `--rev`), so a
later edit of the same file finds the earlier answer in the drafters' shared memory, as a
worker serving that agent would. Files that are binary, added, deleted, larger than
`--max-file-bytes`, or unchanged in text are skipped. Records of one commit share a
conversation and stay together. Stops at `--max-records`.

    python scripts/spec_trace_from_git.py REPO --out trace.jsonl --max-records 200
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

INSTRUCTION = ("Apply the change described below to the file `{path}` and answer with the whole "
               "new file, nothing else.\n\nChange: {message}\n\nThe file now:\n")


def _git(repo: Path, *args: str) -> bytes:
    return subprocess.run(["git", "-C", str(repo), *args], check=True,
                          capture_output=True).stdout


def _commits(repo: Path, rev: str, max_commits: int) -> list[str]:
    out = _git(repo, "log", "--no-merges", "--format=%H %P", f"-n{max_commits}", rev)
    rows = [line.split() for line in out.decode().splitlines()]
    return [row[0] for row in rows[::-1] if len(row) > 1]  # oldest first; not the root


def _modified_files(repo: Path, commit: str) -> list[str]:
    """Paths the commit modified (status M) as text (numstat gives '-' for binary)."""
    out = _git(repo, "diff-tree", "--no-commit-id", "-r", "--numstat", f"{commit}^", commit)
    paths = []
    for line in out.decode(errors="replace").splitlines():
        added, deleted, path = line.split("\t", 2)
        if added != "-" and deleted != "-" and " => " not in path:
            paths.append(path)
    return paths


def _text(repo: Path, rev_path: str, max_bytes: int) -> str | None:
    try:
        data = _git(repo, "show", rev_path)
    except subprocess.CalledProcessError:  # absent on one side (added or deleted)
        return None
    if len(data) > max_bytes or b"\0" in data:
        return None
    try:
        return data.decode()
    except UnicodeDecodeError:
        return None


def records(repo: Path, rev: str = "HEAD", max_commits: int = 1000,
            max_file_bytes: int = 32_000) -> Iterator[dict[str, str]]:
    """The trace's records, oldest commit first (see the module docstring)."""
    for commit in _commits(repo, rev, max_commits):
        message = _git(repo, "log", "-1", "--format=%s", commit).decode(errors="replace").strip()
        for path in _modified_files(repo, commit):
            before = _text(repo, f"{commit}^:{path}", max_file_bytes)
            after = _text(repo, f"{commit}:{path}", max_file_bytes)
            if before is None or after is None or before == after:
                continue
            prompt = INSTRUCTION.format(path=path, message=message) + before
            yield {"id": f"{commit[:12]}:{path}", "conversation": commit[:12],
                   "prompt": prompt, "response": after}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("repo", type=Path, help="a git working tree or bare repository")
    parser.add_argument("--out", type=Path, required=True, help="JSONL trace to write")
    parser.add_argument("--max-records", type=int, default=200, help="records to write")
    parser.add_argument("--max-commits", type=int, default=1000,
                        help="newest non-merge commits to read (replayed oldest first)")
    parser.add_argument("--max-file-bytes", type=int, default=32_000,
                        help="skip files larger than this on either side")
    parser.add_argument("--rev", default="HEAD", help="the history to read")
    args = parser.parse_args(argv)
    written = 0
    with args.out.open("w") as out:
        for record in records(args.repo, args.rev, args.max_commits, args.max_file_bytes):
            if written >= args.max_records:
                break
            out.write(json.dumps(record) + "\n")
            written += 1
    print(f"spec-trace: records={written} out={args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
