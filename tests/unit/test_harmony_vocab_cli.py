"""`decode-worker harmony-vocab --out DIR`: the o200k_base.tiktoken directory smg's harmony
encoding needs offline, written verified (from quicktok-v1, or a copy given with `--from`), the
last line the setting to export; a bad directory, a wrong file or no source is one clear error
(exit 2) and writes nothing."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import pytest

from decode_worker.cli import main
from decode_worker.daemon.shared import harmony_vocab as hv

needs_quicktok = pytest.mark.skipif(importlib.util.find_spec("quicktok") is None,
                                    reason="quicktok-v1 is not installed")


@needs_quicktok
def test_writes_the_verified_vocabulary_and_prints_the_setting(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "vocab" / "nested"  # created
    assert main(["harmony-vocab", "--out", str(out)]) == 0
    text = (out / hv.VOCAB_NAME).read_bytes()
    assert hashlib.sha256(text).hexdigest() == hv.VOCAB_SHA256
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"export TIKTOKEN_ENCODINGS_BASE={out.resolve()}"
    copy = tmp_path / "copy"  # --from: a file fetched elsewhere, checked, copied
    assert main(["harmony-vocab", "--out", str(copy), "--from", str(out / hv.VOCAB_NAME)]) == 0
    assert (copy / hv.VOCAB_NAME).read_bytes() == text


def test_a_file_where_the_directory_should_be_is_a_clear_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    taken = tmp_path / "taken"
    taken.write_text("not a directory")
    assert main(["harmony-vocab", "--out", str(taken)]) == 2
    err = capsys.readouterr().err
    assert f"--out {taken}: exists and is not a directory" in err
    assert taken.read_text() == "not a directory"


def test_a_wrong_file_or_no_source_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    wrong = tmp_path / "o200k_base.tiktoken"
    wrong.write_bytes(b"aGk= 0\n")
    out = tmp_path / "out"
    assert main(["harmony-vocab", "--out", str(out), "--from", str(wrong)]) == 2
    assert "SHA-256 is not the published" in capsys.readouterr().err
    assert main(["harmony-vocab", "--out", str(out), "--from", str(tmp_path / "none")]) == 2
    assert "cannot read it" in capsys.readouterr().err
    monkeypatch.setattr(hv, "quicktok_vocab", lambda: None)  # quicktok-v1 not installed
    assert main(["harmony-vocab", "--out", str(out)]) == 2
    assert "pip install quicktok-v1" in capsys.readouterr().err
    assert not out.exists()
