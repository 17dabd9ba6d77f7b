"""One test per startup rule: each rejection names the fix."""

from __future__ import annotations

import pytest

from decode_worker.core.validation import (
    CacheCombo,
    ModelFacts,
    min_swa_pages_per_request,
    model_facts_from_hf_config,
    validate_startup,
)
from decode_worker.errors import ConfigError

GPT_OSS = ModelFacts(model_type="gpt_oss", num_full_layers=2, num_swa_layers=2, window=127)
DENSE = ModelFacts(model_type="llama", num_full_layers=4, num_swa_layers=0, window=0)


def combo(**kw: object) -> CacheCombo:
    base: dict[str, object] = dict(
        page_size=16, decode_radix_cache=True, unified_radix_tree=True, hierarchical_cache=False
    )
    base.update(kw)
    return CacheCombo(**base)  # type: ignore[arg-type]


def test_default_combination_is_accepted() -> None:
    validate_startup(GPT_OSS, combo())
    validate_startup(DENSE, combo(unified_radix_tree=False))


def test_swa_radix_cache_requires_unified_tree() -> None:
    with pytest.raises(ConfigError, match="ENABLE_UNIFIED_RADIX_TREE=1"):
        validate_startup(GPT_OSS, combo(unified_radix_tree=False))
    validate_startup(GPT_OSS, combo(unified_radix_tree=False, decode_radix_cache=False))


def test_hierarchical_cache_works_with_the_swa_radix_cache() -> None:
    validate_startup(GPT_OSS, combo(hierarchical_cache=True))


def test_hierarchical_cache_needs_the_decode_radix_cache() -> None:
    with pytest.raises(ConfigError, match="hierarchical_cache = true needs the decode radix"):
        validate_startup(GPT_OSS, combo(hierarchical_cache=True, decode_radix_cache=False))


@pytest.mark.parametrize(
    ("facts", "needle"),
    [
        (ModelFacts("deepseek_v4", 4, 0, 0, dsa_compressed_kv=True), "compressed KV"),
        (ModelFacts("gemma4", 2, 2, 511, swa_compress=True), "SWA-compress"),
        (ModelFacts("nemotron_h", 2, 0, 0, mamba=True), "Mamba/SSM"),
    ],
)
def test_unsupported_kv_kinds_rejected_with_radix_cache(facts: ModelFacts, needle: str) -> None:
    with pytest.raises(ConfigError, match=f"{needle}.*decode_radix_cache = false"):
        validate_startup(facts, combo())
    validate_startup(facts, combo(decode_radix_cache=False))


def test_sizes_must_be_positive_and_consistent() -> None:
    with pytest.raises(ConfigError, match="page_size"):
        validate_startup(GPT_OSS, combo(page_size=0))
    with pytest.raises(ConfigError, match="num_full_pages"):
        validate_startup(GPT_OSS, combo(num_full_pages=0))
    need = min_swa_pages_per_request(127, 16)
    with pytest.raises(ConfigError, match=f">= {need}"):
        validate_startup(GPT_OSS, combo(num_swa_pages=need - 1))
    validate_startup(GPT_OSS, combo(num_swa_pages=need))
    with pytest.raises(ConfigError, match="no sliding-window layers"):
        validate_startup(DENSE, combo(num_swa_pages=8))
    with pytest.raises(ConfigError, match="window"):
        validate_startup(ModelFacts("x", 1, 1, 0), combo())


def test_model_facts_from_gpt_oss_config() -> None:
    cfg = {
        "model_type": "gpt_oss",
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "sliding_window": 128,
    }
    facts = model_facts_from_hf_config(cfg)
    assert (facts.num_swa_layers, facts.num_full_layers, facts.window) == (2, 2, 127)
    assert facts.is_swa_hybrid
    assert not (facts.mamba or facts.swa_compress or facts.dsa_compressed_kv)
    with pytest.raises(ConfigError, match="sliding_window"):
        model_facts_from_hf_config({**cfg, "sliding_window": None})
