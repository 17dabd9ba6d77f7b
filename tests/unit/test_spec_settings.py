"""The `speculative` settings: SGLang's flags and names, env, the refusals at start-up (one
line naming the key), `decode-worker config` and /server_info."""

from __future__ import annotations

import pytest

from decode_worker.cli import build_parser, main, resolve
from decode_worker.core.spec import SpecParams
from decode_worker.errors import ConfigError
from decode_worker.io.api.common import ApiConfig
from decode_worker.settings import load_settings


def test_off_by_default_and_sglang_defaults_when_on() -> None:
    spec = load_settings(environ={}).settings.speculative
    assert (spec.enabled, spec.draft_tokens, spec.params()) == (False, None, None)
    ngram = load_settings(environ={"DECODE_WORKER_SPECULATIVE__ALGORITHM": "ngram"})
    assert ngram.settings.speculative.algorithm == "NGRAM"  # any case, SGLang's upper
    assert ngram.settings.speculative.draft_tokens == 12  # SGLang: the max match window
    suffix = load_settings(environ={"DECODE_WORKER_SPECULATIVE__ALGORITHM": "SUFFIX"})
    params = suffix.settings.speculative.params()
    assert params == SpecParams("SUFFIX", num_draft_tokens=24)  # SGLang's SUFFIX default


def test_serve_flags_are_sglangs() -> None:
    args = build_parser().parse_args([
        "serve", "--speculative-algorithm", "SUFFIX", "--speculative-num-draft-tokens", "16",
        "--speculative-suffix-max-tree-depth", "32", "--speculative-suffix-max-spec-factor",
        "2.0", "--speculative-suffix-min-token-prob", "0.2",
        "--speculative-suffix-max-cached-requests", "50",
        "--speculative-ngram-min-match-window-size", "2",
        "--speculative-ngram-max-match-window-size", "6", "--speculative-ngram-capacity", "99"])
    loaded = resolve(args)
    spec = loaded.settings.speculative
    assert (spec.algorithm, spec.num_draft_tokens, spec.suffix_max_tree_depth) == (
        "SUFFIX", 16, 32)
    assert (spec.suffix_max_spec_factor, spec.suffix_min_token_prob) == (2.0, 0.2)
    assert (spec.suffix_max_cached_requests, spec.ngram_capacity) == (50, 99)
    assert (spec.ngram_min_match_window_size, spec.ngram_max_match_window_size) == (2, 6)
    assert loaded.sources["speculative.algorithm"] == "cli"


@pytest.mark.parametrize(("environ", "needle"), [
    ({"ALGORITHM": "EAGLE3"}, "ALGORITHM='EAGLE3': Value error, EAGLE3 needs a draft model, "
                              "which this worker does not run"),
    ({"ALGORITHM": "nextn"}, "NEXTN needs a draft model"),
    ({"ALGORITHM": "standalone"}, "STANDALONE needs a draft model"),
    ({"ALGORITHM": "medusa"}, "ALGORITHM='medusa': Value error, expected none, NGRAM or SUFFIX"),
    ({"NUM_DRAFT_TOKENS": "0"}, "NUM_DRAFT_TOKENS='0': Input should be greater than or equal"),
    ({"NUM_DRAFT_TOKENS": "33"}, "NUM_DRAFT_TOKENS='33': Input should be less than or equal"),
    ({"NGRAM_MIN_MATCH_WINDOW_SIZE": "5", "NGRAM_MAX_MATCH_WINDOW_SIZE": "3"},
     "NGRAM_MAX_MATCH_WINDOW_SIZE='3': Value error, must be at least "
     "ngram_min_match_window_size (5)"),
    ({"SUFFIX_MAX_TREE_DEPTH": "1"}, "SUFFIX_MAX_TREE_DEPTH='1'"),
    ({"SUFFIX_MIN_TOKEN_PROB": "1.5"}, "SUFFIX_MIN_TOKEN_PROB='1.5'"),
    ({"SUFFIX_MAX_SPEC_FACTOR": "0"}, "SUFFIX_MAX_SPEC_FACTOR='0'"),
])
def test_invalid_combinations_stop_with_one_line_naming_the_key(environ: dict[str, str],
                                                                 needle: str) -> None:
    env = {f"DECODE_WORKER_SPECULATIVE__{k}": v for k, v in environ.items()}
    with pytest.raises(ConfigError) as info:
        load_settings(environ=env)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_serve_refuses_a_draft_model_algorithm_before_starting(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--speculative-algorithm", "EAGLE", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "speculative.algorithm='EAGLE'" in err and "needs a draft model" in err


def test_config_and_server_info_name_the_settings(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--set", "speculative.algorithm=NGRAM",
                 "--set", "speculative.num_draft_tokens=6"]) == 0
    out = capsys.readouterr().out
    assert 'speculative.algorithm' in out and '"NGRAM"  # cli' in out
    assert "speculative.suffix_max_tree_depth" in out
    settings = load_settings(None, {"speculative.algorithm": "NGRAM",
                                    "speculative.num_draft_tokens": 6}).settings
    info = ApiConfig.from_settings(settings).server_info_defaults
    assert info["speculative_algorithm"] == "NGRAM"
    assert info["speculative_num_draft_tokens"] == 6
    assert info["speculative_ngram_max_match_window_size"] == 12
    assert info["speculative_suffix_max_tree_depth"] == 24
    off = ApiConfig.from_settings(load_settings(environ={}).settings).server_info_defaults
    assert off["speculative_algorithm"] is None and off["speculative_num_draft_tokens"] is None
