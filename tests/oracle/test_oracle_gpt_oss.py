"""Paged runtime vs transformers' GptOssForCausalLM on the same tiny weights (float32).

Tolerance: logits agree within LOGIT_ATOL = 1e-4 absolute (observed ~2e-7; logits are ~0.5 in
magnitude and the smallest top-1/top-2 gap seen at this init is ~3.6e-4, so token equality alone
would be a weak check: adding 0.5 to one early token's full-attention K was seen to leave all
32 greedy tokens unchanged, with the logits moving by at most 7e-4).
"""

from __future__ import annotations

import pytest
import torch

from decode_worker.device.kv_pool import KVPools, KVSpec
from decode_worker.device.model.gpt_oss import GptOssModel
from decode_worker.device.runner import ModelRunner
from decode_worker.utils.mathx import align_down
from tests.decode_steps import decode_lists
from tests.oracle.helpers import PageBook, reference_greedy

LOGIT_ATOL = 1e-4


def make_runner(model: GptOssModel, page_size: int, pages: int = 400) -> ModelRunner:
    pools = KVPools(KVSpec.from_config(model.cfg), pages, pages, page_size, "cpu", torch.float32)
    return ModelRunner(model, pools, use_cuda_graph=False, graph_batch_sizes=[1])


def prompt_of(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (length,), generator=gen).tolist()


def paged_greedy(runner: ModelRunner, prompts: list[list[int]], steps: int,
                 drop_swa: bool = False) -> tuple[list[list[int]], torch.Tensor]:
    """Prefill each prompt, then decode all of them together; ([n][steps], [n, steps, V])."""
    ps, window = runner.pools.page_size, runner.window
    book = PageBook(ps)
    seqs, tables, logits = [], [], []
    for prompt in prompts:
        full, swa = book.tables(len(prompt))
        if drop_swa:  # pages wholly before the window start are not held (SWA id 0)
            start = align_down(max(0, len(prompt) - window), ps)
            swa[: start // ps] = [0] * (start // ps)
        lg = runner.prefill(prompt, full, swa)
        seqs.append([*prompt, int(lg.argmax())])
        tables.append((full, swa))
        logits.append([lg])
    for _ in range(steps - 1):
        positions = [len(s) - 1 for s in seqs]
        for (full, swa), pos in zip(tables, positions, strict=True):
            book.grow(full, "full", pos + 1)
            book.grow(swa, "swa", pos + 1)
            if drop_swa:
                for i in range(max(0, pos - window) // ps):
                    swa[i] = 0
        out = decode_lists(runner, [s[-1] for s in seqs], positions, [t[0] for t in tables],
                           [t[1] for t in tables])  # [n, V]
        for i, s in enumerate(seqs):
            s.append(int(out[i].argmax()))
            logits[i].append(out[i])
    gen = [s[len(p):] for s, p in zip(seqs, prompts, strict=True)]
    return gen, torch.stack([torch.stack(lg) for lg in logits])


def check_against_reference(reference, prompts, gen, logits):  # type: ignore[no-untyped-def]
    steps = len(gen[0])
    for i, prompt in enumerate(prompts):
        ref_tokens, ref_logits = reference_greedy(reference, prompt, steps)
        diff = (logits[i] - ref_logits).abs().max().item()
        assert diff < LOGIT_ATOL, f"prompt {i} (len {len(prompt)}): max logit diff {diff}"
        assert gen[i] == ref_tokens, f"prompt {i} (len {len(prompt)})"


def test_single_prompt_above_window_matches_reference(model: GptOssModel, reference) -> None:
    prompts = [prompt_of(150, seed=1)]
    gen, logits = paged_greedy(make_runner(model, 16), prompts, steps=24)
    check_against_reference(reference, prompts, gen, logits)


def test_mixed_batch_around_window_and_page_edges_matches_reference(
        model: GptOssModel, reference) -> None:
    lengths = [1, 15, 16, 17, 120, 127, 128, 129, 200]
    prompts = [prompt_of(n, seed=10 + n) for n in lengths]
    gen, logits = paged_greedy(make_runner(model, 16), prompts, steps=12)
    check_against_reference(reference, prompts, gen, logits)


def test_page_size_one_with_unheld_swa_pages_matches_reference(
        model: GptOssModel, reference) -> None:
    prompts = [prompt_of(n, seed=n) for n in (126, 131)]
    gen, logits = paged_greedy(make_runner(model, 1, pages=800), prompts, steps=8, drop_swa=True)
    check_against_reference(reference, prompts, gen, logits)


def test_unheld_swa_pages_before_window_start_do_not_change_output(model: GptOssModel) -> None:
    prompts = [prompt_of(n, seed=n) for n in (100, 140, 260)]
    held, held_logits = paged_greedy(make_runner(model, 16), prompts, steps=40)
    dropped, dropped_logits = paged_greedy(make_runner(model, 16), prompts, steps=40,
                                           drop_swa=True)
    assert held == dropped
    assert torch.equal(held_logits, dropped_logits)


def test_batched_rows_equal_solo_runs(model: GptOssModel) -> None:
    prompts = [prompt_of(n, seed=n) for n in (5, 64, 130)]
    batched, batched_logits = paged_greedy(make_runner(model, 16), prompts, steps=10)
    for i, prompt in enumerate(prompts):
        solo, solo_logits = paged_greedy(make_runner(model, 16), [prompt], steps=10)
        assert solo[0] == batched[i]
        assert torch.allclose(solo_logits[0], batched_logits[i], atol=1e-6, rtol=0)


@pytest.mark.parametrize(("split", "page_size"), [(64, 16), (70, 16), (128, 16), (149, 1)])
def test_prefix_hit_plus_fresh_tail_equals_full_compute(
        model: GptOssModel, reference, split: int, page_size: int) -> None:
    """Decode-side radix case: request B reuses request A's filled pages for a shared prefix
    and computes only its own tail; the result must not change."""
    runner = make_runner(model, page_size, pages=600)
    book = PageBook(page_size)
    prompt_a = prompt_of(150, seed=3)
    prompt_b = prompt_a[:split] + prompt_of(40, seed=4)
    full_a, swa_a = book.tables(len(prompt_a))
    runner.prefill(prompt_a, full_a, swa_a)
    shared = split // page_size  # whole pages B takes over from A
    full_b, swa_b = full_a[:shared], swa_a[:shared]
    book.grow(full_b, "full", len(prompt_b))
    book.grow(swa_b, "swa", len(prompt_b))
    start = shared * page_size  # B recomputes from the end of the shared pages
    hit = runner.prefill(prompt_b, full_b, swa_b, start_pos=start)
    whole = make_runner(model, page_size, pages=600).prefill(
        prompt_b, *PageBook(page_size).tables(len(prompt_b)))
    assert (hit - whole).abs().max().item() < 1e-5
    _, ref_logits = reference_greedy(reference, prompt_b, 1)
    assert (hit - ref_logits[0]).abs().max().item() < LOGIT_ATOL
    tok = int(hit.argmax())
    book.grow(full_b, "full", len(prompt_b) + 1)
    book.grow(swa_b, "swa", len(prompt_b) + 1)
    nxt = decode_lists(runner, [tok], [len(prompt_b)], [full_b], [swa_b])[0]
    _, ref2 = reference_greedy(reference, [*prompt_b, tok], 1)
    assert (nxt - ref2[0]).abs().max().item() < LOGIT_ATOL


def test_transformers_loads_the_written_model_with_identical_weights(
        model_dir, reference) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file

    saved = load_file(str(model_dir / "model.safetensors"))
    loaded = reference.state_dict()
    assert set(saved) == set(loaded)
    for name, tensor in saved.items():
        assert torch.equal(tensor, loaded[name]), name


def test_long_prompt_prefilled_in_query_chunks_matches_reference(
        model: GptOssModel, reference, monkeypatch: pytest.MonkeyPatch) -> None:
    import decode_worker.device.attention as attention

    prompts = [prompt_of(700, seed=7)]
    gen, logits = paged_greedy(make_runner(model, 16), prompts, steps=3)  # 512-query chunks
    check_against_reference(reference, prompts, gen, logits)
    monkeypatch.setattr(attention, "SCORE_BUDGET", 1)  # 16-query chunks
    small_gen, small_logits = paged_greedy(make_runner(model, 16), prompts, steps=3)
    assert small_gen == gen
    assert (small_logits - logits).abs().max().item() < 1e-5


def test_split_key_decode_matches_reference(model: GptOssModel, reference,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Long contexts gather keys in chunks (split-K); force 40-key chunks here."""
    import decode_worker.device.attention as attention

    lengths = [3, 127, 129, 200]
    prompts = [prompt_of(n, seed=20 + n) for n in lengths]
    monkeypatch.setattr(attention, "DECODE_KV_BUDGET", 40 * len(lengths) * 2 * 2 * 16)
    gen, logits = paged_greedy(make_runner(model, 16), prompts, steps=6)
    check_against_reference(reference, prompts, gen, logits)


def test_pool_contents_equal_the_reference_cache_k_after_rope(
        model: GptOssModel, reference) -> None:
    """What a transfer ships: full layers hold K/V of every token, SWA layers of (at least) the
    last window tokens, in the reference cache's values (K after RoPE)."""
    from transformers import DynamicCache

    runner, ps, n = make_runner(model, 16), 16, 200
    prompt = prompt_of(n, seed=9)
    full, swa = PageBook(ps).tables(n)
    runner.prefill(prompt, full, swa)
    cache = DynamicCache(config=reference.config)
    with torch.no_grad():
        reference(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
    pos = torch.arange(n)
    for layer in range(model.cfg.num_hidden_layers):
        table = torch.tensor(full if runner.pools.layer_slot(layer)[0] == "full" else swa)
        kv = runner.pools.layer_tensor(layer)[table[pos // ps], :, pos % ps]  # [n, 2, kvh, hd]
        ref_k = cache.layers[layer].keys[0].transpose(0, 1)  # [kept, kvh, hd]
        ref_v = cache.layers[layer].values[0].transpose(0, 1)
        kept = ref_k.shape[0]  # 200 on full layers, window (127) on sliding ones
        assert kept == (n if layer in model.cfg.full_layers else model.cfg.window)
        assert torch.allclose(kv[-kept:, 0], ref_k, atol=1e-5, rtol=0)
        assert torch.allclose(kv[-kept:, 1], ref_v, atol=1e-5, rtol=0)
