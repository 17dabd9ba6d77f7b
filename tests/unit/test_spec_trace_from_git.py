"""scripts/spec_trace_from_git.py: one record per file a commit modified, oldest first."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from scripts import spec_trace_from_git as trace


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                    *args], check=True, capture_output=True)


def test_records_hold_the_file_before_and_after_each_commit(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    (repo / "b.bin").write_bytes(b"\0\1")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "first")
    (repo / "a.py").write_text("x = 2\n")
    (repo / "b.bin").write_bytes(b"\0\2")  # binary: skipped
    (repo / "c.py").write_text("new\n")  # added: no file before, skipped
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "bump x")
    (repo / "a.py").write_text("x = 3\n")
    _git(repo, "commit", "-qam", "bump x again")
    out = tmp_path / "t.jsonl"
    assert trace.main([str(repo), "--out", str(out), "--max-records", "5"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["response"] for r in records] == ["x = 2\n", "x = 3\n"]  # oldest first
    assert records[0]["prompt"].endswith("Change: bump x\n\nThe file now:\nx = 1\n")
    assert records[0]["id"].endswith(":a.py") and records[0]["conversation"] != \
        records[1]["conversation"]
    assert trace.main([str(repo), "--out", str(out), "--max-records", "1"]) == 0
    assert len(out.read_text().splitlines()) == 1
