"""Paged runtime vs transformers on tiny checkpoints of every non-gpt-oss family (float32),
each written by transformers itself with config.json in the hub's keys (tests/families.py).

Prompts around page edges (page 16) and, for Gemma 3, its window edges (HF sliding_window 32:
window 31), decoded together in one batch; SWA pages before the window start are dropped, as
the worker does. Tolerance as for gpt-oss: logits within 1e-4 (observed < 1e-6).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from decode_worker.device.kv_pool import KVPools, KVSpec
from decode_worker.device.model.arch import ModelConfig
from decode_worker.device.model.base import CausalLM
from decode_worker.device.model.registry import load_model, read_json
from decode_worker.device.runner import ModelRunner
from tests.decode_steps import decode_lists
from tests.families import FAMILIES, reference_model
from tests.oracle.helpers import PageBook, reference_greedy
from tests.oracle.test_oracle_gpt_oss import check_against_reference, paged_greedy, prompt_of

LENGTHS = {"gemma3": [1, 15, 31, 32, 33, 47, 70], "llama": [1, 16, 17, 40],
           "qwen3": [15, 16, 33, 70], "qwen3_moe": [1, 17, 48]}


def runner_of(model: CausalLM, page_size: int = 16, pages: int = 300) -> ModelRunner:
    pools = KVPools(KVSpec.from_config(model.cfg), pages, pages, page_size, "cpu",
                    torch.float32)
    return ModelRunner(model, pools, use_cuda_graph=False, graph_batch_sizes=[1])


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request: pytest.FixtureRequest, family_dir: Callable[[str], Path]
                 ) -> tuple[str, CausalLM, object]:
    path = family_dir(request.param)
    return request.param, load_model(path, "cpu", torch.float32), reference_model(path)


def test_batch_around_page_and_window_edges_matches_reference(
        family_model) -> None:  # type: ignore[no-untyped-def]
    family, model, reference = family_model
    prompts = [prompt_of(n, seed=30 + n) for n in LENGTHS[family]]
    gen, logits = paged_greedy(runner_of(model), prompts, steps=10, drop_swa=True)
    check_against_reference(reference, prompts, gen, logits)


def test_prefix_hit_plus_fresh_tail_matches_reference(
        family_model) -> None:  # type: ignore[no-untyped-def]
    """A later turn reuses the earlier turn's full pages (and, with SWA, the window before the
    split) and computes only its tail."""
    _family, model, reference = family_model
    runner, book = runner_of(model), PageBook(16)
    first = prompt_of(60, seed=3)
    later = first[:48] + prompt_of(20, seed=4)
    full_a, swa_a = book.tables(len(first))
    runner.prefill(first, full_a, swa_a)
    full_b, swa_b = full_a[:3], swa_a[:3]
    book.grow(full_b, "full", len(later) + 1)
    book.grow(swa_b, "swa", len(later) + 1)
    hit = runner.prefill(later, full_b, swa_b, start_pos=48)
    _, ref = reference_greedy(reference, later, 1)
    assert (hit - ref[0]).abs().max().item() < 1e-4
    tok = int(hit.argmax())
    nxt = decode_lists(runner, [tok], [len(later)], [full_b], [swa_b])[0]
    _, ref2 = reference_greedy(reference, [*later, tok], 1)
    assert (nxt - ref2[0]).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_hub_and_transformers_config_forms_read_the_same(
        family: str, family_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """config.json in the hub's keys (rope_theta, rope_scaling, rope_local_base_freq,
    sliding_window_pattern, torch_dtype) and as transformers 5 writes it (rope_parameters,
    per layer type for Gemma 3; layer_types; dtype) describe the same model."""
    from decode_worker.device.model.registry import family_of

    path = family_dir(family)
    hub, written = read_json(path / "config.json"), read_json(path / "config.transformers.json")
    assert "rope_parameters" in written and "rope_parameters" not in hub
    a = family_of(hub).read_config(hub, "hub")
    b = family_of(written).read_config(written, "transformers")
    assert isinstance(a, ModelConfig) and isinstance(b, ModelConfig)
    for field in ("layer_types", "window", "moe", "head_dim", "attn_scale", "vocab_size",
                  "tie_word_embeddings", "embed_scale", "final_logit_softcapping"):
        assert getattr(a, field) == getattr(b, field), field
    assert {t: (r.rope_type, r.theta, r.params.get("factor")) for t, r in a.rope.items()} == \
        {t: (r.rope_type, r.theta, r.params.get("factor")) for t, r in b.rope.items()}


def test_gemma3_pools_hold_the_reference_cache_window(family_dir: Callable[[str], Path]) -> None:
    """Sliding layers keep (at least) the window of K (after RoPE) and V, global layers every
    token, each equal to what transformers caches."""
    from transformers import DynamicCache

    path = family_dir("gemma3")
    model, reference = load_model(path, "cpu", torch.float32), reference_model(path)
    runner, n = runner_of(model), 70
    prompt = prompt_of(n, seed=9)
    full, swa = PageBook(16).tables(n)
    runner.prefill(prompt, full, swa)
    cache = DynamicCache(config=reference.config)
    with torch.no_grad():
        reference(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
    pos = torch.arange(n)
    for layer in range(model.cfg.num_hidden_layers):
        sliding = runner.pools.layer_slot(layer)[0] == "swa"
        table = torch.tensor(swa if sliding else full)
        kv = runner.pools.layer_tensor(layer)[table[pos // 16], :, pos % 16]  # [n, 2, kvh, hd]
        keep = model.cfg.window if sliding else n
        ref_k = cache.layers[layer].keys[0].transpose(0, 1)[-keep:]  # [keep, kvh, hd]
        ref_v = cache.layers[layer].values[0].transpose(0, 1)[-keep:]
        assert torch.allclose(kv[-keep:, 0], ref_k, atol=1e-5, rtol=0), layer
        assert torch.allclose(kv[-keep:, 1], ref_v, atol=1e-5, rtol=0), layer
