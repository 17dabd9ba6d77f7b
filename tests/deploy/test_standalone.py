"""The repository stands alone: no tracked file points outside it or at one machine's paths.

Someone who clones the repository has only its files, so code, docs and tests cite public
sources (upstream files, pull requests, vendor pages) or this repository's own `docs/`
(PROTOCOLS.md, GPU.md, STYLE.md, ...). The rule, applied to every line of every file
`git ls-files` lists (files that are not UTF-8 text, or hold a NUL byte, are skipped as binary;
so is this file, whose rule must spell the patterns it looks for):

- `shared/design`, `shared/STYLE` and `../shared` anywhere: a team folder beside the checkout.
  Files inside the package are named from the repository root instead
  (`decode_worker/daemon/shared/procs.py`, never `../shared/procs.py`).
- an absolute path under `/work` or `/root` (a work tree, root's home), under `/home/<user>` or
  `/Users/<user>` (someone's home): the path must start the token, i.e. follow the start of the
  line, a space, a quote, a bracket, `=`, `:` or `,`, or `file://`; a `/` inside a longer path
  (`homework/`, `network/x`, `a/work/b`) is not one. Exempt: `/home/decode`, the home of the
  service user the Dockerfile creates in the product's image.

Not flagged, because they are the same on every machine or belong to the product's deployment:
`/proc`, `/dev/shm`, `/etc/...`, `/usr/...`, `/var/lib/decode-worker`, `/opt/decode-worker`,
`/srv/models`, `/models/...`, `/tmp/...`, `~/...` and `$HOME/...`.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()
# where an absolute path may start: not after a path character, or right after `file://`
_START = r"(?:(?<![\w.~$}/-])|(?<=file://))"
_END = r"(?=[/\s\"'`),;:\]]|$)"
PATTERNS = (
    re.compile(r"shared/(?:design|STYLE)"),
    re.compile(r"\.\./shared\b"),
    re.compile(_START + r"/(?:work|root)" + _END),
    re.compile(_START + r"/home/(?!decode" + _END + r")[A-Za-z_][\w.-]*"),
    re.compile(_START + r"/Users/[A-Za-z_][\w.-]*"),
)


def offences(line: str) -> list[str]:
    """What in `line` points outside the repository or at one machine (see the module doc)."""
    return [m.group(0) for p in PATTERNS for m in p.finditer(line)]


def tracked_text_files() -> dict[str, str]:
    """Path (from the repository root) -> text of every tracked UTF-8 text file but this one."""
    try:
        done = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                              timeout=60, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"not a git checkout ({exc})")
    out: dict[str, str] = {}
    for name in done.stdout.decode().split("\0"):
        path = ROOT / name
        if not name or name == SELF or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            out[name] = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
    return out


def test_no_tracked_file_points_outside_the_repository() -> None:
    files = tracked_text_files()
    assert "README.md" in files and "pyproject.toml" in files, "git ls-files listed nothing"
    bad = [f"{name}:{lineno}: {hit}"
           for name, text in sorted(files.items())
           for lineno, line in enumerate(text.splitlines(), 1)
           for hit in offences(line)]
    assert not bad, ("files point outside the repository; cite docs/ (PROTOCOLS.md, GPU.md, "
                     "STYLE.md) or a public source instead:\n" + "\n".join(bad))


@pytest.mark.parametrize("line", [
    "see shared/design/gpu.md section 2",
    "House rules: `../shared/STYLE.md`",
    "(in the checkout: `/work/shared/STYLE.md`)",
    "cd /work && make",
    "PYTHONPATH=/work/main pytest",
    "log: /root/.cache/x",
    'path = "/home/alice/models"',
    "file:///work/main/README.md",
    "open /Users/bob/src",
])
def test_rule_flags_outside_paths(line: str) -> None:
    assert offences(line)


@pytest.mark.parametrize("line", [
    "cat /proc/self/status; ls /dev/shm",
    "install to /etc/systemd/system/decode-worker@.service",
    "ExecStart=/opt/decode-worker/bin/decode-worker serve",
    "WorkingDirectory=/var/lib/decode-worker/%i",
    "OUT=${OUT:-/tmp/gpu_check}; /usr/bin/env python3",
    "--home-dir /home/decode decode; WORKDIR /home/decode",
    "homework/ and network/x and a/work/b",
    "decode_worker/daemon/shared/procs.py",
    "~/.cache/decode-worker and $HOME/work/x",
    "-v /srv/models:/models:ro",
])
def test_rule_leaves_product_and_system_paths_alone(line: str) -> None:
    assert offences(line) == []
