"""`decode-worker spec-sim`: known answers on small generated traces, the exact last line,
text records through the o200k tokenizer, and bad input named by its line."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from decode_worker.cli import main

LAST = re.compile(r"spec-sim: records=(\d+) output_tokens=(\d+) verify_steps=(\d+) "
                  r"accept_length=([\d.]+) proposed=(\d+) accepted=(\d+) efficiency=([\d.]+) "
                  r"draft_us_per_step=([\d.]+)")


def _trace(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _last(capsys: pytest.CaptureFixture[str], argv: list[str]) -> re.Match[str]:
    assert main(["spec-sim", *argv]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    match = LAST.fullmatch(lines[-1])
    assert match, lines[-1]
    return match


def test_known_answer_for_a_response_that_copies_its_prompt(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Step 1: nothing matches "10" (bonus 1); step 2: "1" matched, drafts 2-5, all kept,
    bonus 6; step 3: drafts 7-10, all kept, the response is done."""
    trace = _trace(tmp_path / "t.jsonl", [{"id": "a", "conversation": "c",
                                           "prompt": list(range(1, 11)),
                                           "response": list(range(1, 11))}])
    m = _last(capsys, [str(trace), "--speculative-algorithm", "NGRAM",
                       "--speculative-num-draft-tokens", "4"])
    assert m.groups()[:7] == ("1", "10", "3", "3.333", "8", "8", "1.000")


@pytest.mark.parametrize(("algorithm", "floor"), [("NGRAM", 8.0), ("SUFFIX", 7.0)])
def test_repeated_prompt_earns_nearly_k_plus_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], algorithm: str,
        floor: float) -> None:
    rng = random.Random(1)
    prompt = rng.sample(range(1000, 50_000), 400)
    trace = _trace(tmp_path / "t.jsonl", [{"id": "a", "conversation": "c", "prompt": prompt,
                                           "response": prompt}])
    m = _last(capsys, [str(trace), "--speculative-algorithm", algorithm,
                       "--speculative-num-draft-tokens", "8"])
    accept_length, efficiency = float(m.group(4)), float(m.group(7))
    assert floor <= accept_length <= 9.0
    assert efficiency > 0.95  # a copy: drafts fail only past the response's end


def test_a_later_request_finds_an_earlier_answer_and_both_algorithms_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = random.Random(2)
    answer = [rng.randrange(100_000) for _ in range(300)]
    trace = _trace(tmp_path / "t.jsonl", [
        {"id": "1", "conversation": "x", "prompt": [1, 2, 3], "response": answer},
        {"id": "2", "conversation": "y", "prompt": [9, 1, 2, 3], "response": answer}])
    assert main(["spec-sim", str(trace), "--speculative-num-draft-tokens", "8"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in out if line.startswith(("NGRAM", "SUFF"))}
    assert set(rows) == {"NGRAM", "SUFFIX"}  # none configured: both, SUFFIX last
    m = LAST.fullmatch(out[-1])
    assert m and m.group(2) == "600" and int(m.group(3)) < 300 + 300 // 8 + 10
    assert rows["SUFFIX"][3] == m.group(3)  # the last line is SUFFIX's row


def test_text_records_use_the_o200k_tokenizer(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("quicktok", reason="the o200k vocabulary ships in quicktok-v1")
    text = "def add(a, b):\n    return a + b\n" * 20
    trace = _trace(tmp_path / "t.jsonl", [{"id": "a", "conversation": "c",
                                           "prompt": "<|start|>user<|message|>" + text,
                                           "response": text}])
    m = _last(capsys, [str(trace), "--speculative-algorithm", "SUFFIX",
                       "--speculative-num-draft-tokens", "8"])
    assert int(m.group(2)) == 20 * 12  # o200k: 12 tokens per copy of the function
    assert float(m.group(4)) > 5.0


def test_a_bad_record_is_named_by_its_line(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"prompt": [1], "response": [2]}) + "\n"
                     + json.dumps({"prompt": [1], "response": [-3]}) + "\n")
    assert main(["spec-sim", str(trace), "--speculative-algorithm", "NGRAM"]) == 2
    err = capsys.readouterr().err
    assert f"{trace}:2" in err and "'response'" in err


def test_model_dir_tokenizer_reads_text(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    from decode_worker.device.default_model import byte_tokenizer

    model = tmp_path / "model"
    model.mkdir()
    byte_tokenizer().save(str(model / "tokenizer.json"))  # one id per byte
    trace = _trace(tmp_path / "t.jsonl", [{"id": "a", "conversation": "c",
                                           "prompt": "hello world", "response": "world!"}])
    m = _last(capsys, [str(trace), "--model", str(model), "--speculative-algorithm", "NGRAM"])
    assert m.group(2) == "6"  # "world!": six bytes
