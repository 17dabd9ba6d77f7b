"""scripts/bench_kv_footprint.py: the footprint table from the real public shapes."""

from __future__ import annotations

from scripts.bench_kv_footprint import MODELS, footprint, report


def test_gemma3_27b_holds_about_five_times_less_kv_at_32k() -> None:
    f = footprint(MODELS["Gemma-3-27B"], 16)
    assert (f["full"], f["swa"], f["window"]) == (10, 52, 1023)
    ours, everything = f[32768]
    assert everything == 62 * 32768 * 2 * 16 * 128 * 2  # every layer, every token, bf16
    assert 5.0 < everything / ours < 5.5


def test_models_without_sliding_layers_hold_the_same_either_way() -> None:
    for name in ("Qwen3-32B", "Qwen3-30B-A3B", "Llama-3.1-8B"):
        f = footprint(MODELS[name], 16)
        assert f["swa"] == 0 and f[8192][0] == f[8192][1]
    text = report(16, 40.0)
    assert all(name in text for name in MODELS)
