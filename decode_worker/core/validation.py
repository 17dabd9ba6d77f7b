"""Startup validation of the model/cache combination (pure).

Each rule rejects one unsupported combination with a message that names the fix. The daemon
calls `validate_startup` before it allocates anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from decode_worker.errors import ConfigError
from decode_worker.utils.mathx import cdiv

_SWA_COMPRESS_TYPES = frozenset({"gemma4", "gemma4_text", "mimo_v2", "mimo_v2_flash"})
_DSA_TYPES = frozenset({"deepseek_v4", "deepseek_v32"})
_MAMBA_MARKERS = ("mamba", "ssm", "linear_attention", "jamba", "nemotron_h", "qwen3_next")


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What validation needs to know about a model, read from its HF config.json.

    `window` is the number of earlier tokens a sliding-window query sees (HF `sliding_window`
    minus one: 127 for gpt-oss); 0 when the model has no sliding-window layers.
    """

    model_type: str
    num_full_layers: int
    num_swa_layers: int
    window: int
    dsa_compressed_kv: bool = False
    swa_compress: bool = False
    mamba: bool = False

    @property
    def is_swa_hybrid(self) -> bool:
        return self.num_swa_layers > 0


@dataclass(frozen=True, slots=True)
class CacheCombo:
    """The cache settings that validation checks (plain values, copied from Settings)."""

    page_size: int
    decode_radix_cache: bool
    unified_radix_tree: bool
    hierarchical_cache: bool | None
    num_full_pages: int | None = None
    num_swa_pages: int | None = None


def model_facts_from_hf_config(config: dict[str, Any]) -> ModelFacts:
    """Read ModelFacts from a parsed Hugging Face config.json.

    Raises:
        ConfigError: a sliding-window layer without a positive `sliding_window`.
    """
    model_type = str(config.get("model_type", "")).lower()
    num_layers = int(config.get("num_hidden_layers", 0))
    layer_types = [str(t) for t in (config.get("layer_types") or ["full_attention"] * num_layers)]
    num_swa = sum(1 for t in layer_types if t == "sliding_attention")
    num_full = sum(1 for t in layer_types if t == "full_attention")
    hf_window = config.get("sliding_window")
    if num_swa and (not isinstance(hf_window, int) or hf_window <= 1):
        raise ConfigError(
            f"model config: sliding_attention layers need sliding_window > 1, got {hf_window!r}"
        )
    return ModelFacts(
        model_type=model_type,
        num_full_layers=num_full,
        num_swa_layers=num_swa,
        window=hf_window - 1 if num_swa and isinstance(hf_window, int) else 0,
        dsa_compressed_kv=model_type in _DSA_TYPES or "index_topk" in config,
        swa_compress=model_type in _SWA_COMPRESS_TYPES or bool(config.get("swa_compress")),
        mamba=any(m in model_type for m in _MAMBA_MARKERS)
        or any(any(m in t for m in _MAMBA_MARKERS) for t in layer_types),
    )


def validate_startup(model: ModelFacts, cache: CacheCombo) -> None:
    """Raise ConfigError for the first unsupported combination; return None if all is well."""
    for rule in _RULES:
        rule(model, cache)


def min_swa_pages_per_request(window: int, page_size: int) -> int:
    """SWA pages one request needs at most: a tail with margin plus the page being written.

    The tail starts at most `max(window, page_size) + 1` tokens before the end, rounded down to a
    page, so it spans at most cdiv(max(window, page_size) + 1, page_size) + 1 pages.
    """
    return cdiv(max(window, page_size) + 1, page_size) + 1


def _check_sizes(model: ModelFacts, cache: CacheCombo) -> None:
    if cache.page_size <= 0:
        raise ConfigError(f"cache.page_size={cache.page_size}: must be a positive number of tokens")
    if model.is_swa_hybrid and model.window <= 0:
        raise ConfigError(f"model window={model.window}: a sliding-window model needs window > 0")
    for key, pages in (("num_full_pages", cache.num_full_pages),
                       ("num_swa_pages", cache.num_swa_pages)):
        if pages is not None and pages <= 0:
            raise ConfigError(f"cache.{key}={pages}: must be positive (or unset to derive it)")
    if model.is_swa_hybrid and cache.num_swa_pages is not None:
        need = min_swa_pages_per_request(model.window, cache.page_size)
        if cache.num_swa_pages < need:
            raise ConfigError(
                f"cache.num_swa_pages={cache.num_swa_pages}: one request's SWA tail needs {need} "
                f"pages (window {model.window}, page {cache.page_size}); raise it to >= {need}"
            )
    if not model.is_swa_hybrid and cache.num_swa_pages:
        raise ConfigError(
            f"cache.num_swa_pages={cache.num_swa_pages}: model {model.model_type!r} has no "
            "sliding-window layers; unset cache.num_swa_pages"
        )


def _check_unified_tree(model: ModelFacts, cache: CacheCombo) -> None:
    if cache.decode_radix_cache and model.is_swa_hybrid and not cache.unified_radix_tree:
        raise ConfigError(
            "the decode radix cache with a sliding-window hybrid model requires the unified radix "
            "tree: set ENABLE_UNIFIED_RADIX_TREE=1 (cache.unified_radix_tree = true), or turn the "
            "cache off with DECODE_WORKER_CACHE__DECODE_RADIX_CACHE=false"
        )


def _check_hierarchical(model: ModelFacts, cache: CacheCombo) -> None:
    """The host tier lives under the decode radix tree (SGLang: decode HiCache needs the decode
    radix cache); with SWA hybrids it holds full-attention KV only (the SWA tail always arrives
    from the prefill), so unlike SGLang's decode side it is allowed there."""
    if cache.hierarchical_cache and not cache.decode_radix_cache:
        raise ConfigError(
            "cache.hierarchical_cache = true needs the decode radix cache: set "
            "cache.decode_radix_cache = true, or cache.hierarchical_cache = false"
        )


def _check_kv_kinds(model: ModelFacts, cache: CacheCombo) -> None:
    if not cache.decode_radix_cache:
        return
    fix = "run without the cache: cache.decode_radix_cache = false"
    if model.dsa_compressed_kv:
        raise ConfigError(
            f"DeepSeek-V4-style compressed KV (DSA, {model.model_type!r}) is not supported with "
            f"the decode radix cache; {fix}"
        )
    if model.swa_compress:
        raise ConfigError(
            f"SWA-compress models ({model.model_type!r}, Gemma4/MiMo-V2 style) are not supported "
            f"with the decode radix cache; {fix}"
        )
    if model.mamba:
        raise ConfigError(
            f"Mamba/SSM hybrid models ({model.model_type!r}) are not supported with the decode "
            f"radix cache; {fix}"
        )


_RULES = (_check_sizes, _check_unified_tree, _check_hierarchical, _check_kv_kinds)
