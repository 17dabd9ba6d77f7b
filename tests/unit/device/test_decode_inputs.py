"""Persistent decode inputs (`DecodeInputs`, `ModelRunner.decode_rows`): rows kept between steps
give the same logits as rows written afresh from page lists, eager and through the graph path,
across page edges and the SWA window; bad page ids refused when written."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from decode_worker.device.cuda_graph import FakeGraphBackend
from decode_worker.device.default_model import write_model
from decode_worker.device.kv_pool import KVPools, KVSpec
from decode_worker.device.model.gpt_oss import GptOssModel
from decode_worker.device.model.weights import load_model
from decode_worker.device.runner import ModelRunner
from decode_worker.errors import PageError
from decode_worker.utils.mathx import cdiv
from tests.decode_steps import decode_lists

PAGE = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> GptOssModel:
    return load_model(write_model(tmp_path_factory.mktemp("m"), seed=0), "cpu", torch.float32)


def runner_for(model: GptOssModel, graphs: bool) -> ModelRunner:
    pools = KVPools(KVSpec.from_config(model.cfg), 160, 160, PAGE, "cpu", torch.float32)
    return ModelRunner(model, pools, use_cuda_graph=graphs, graph_batch_sizes=[1, 2, 4],
                       max_graph_pages=32, graph_backend=FakeGraphBackend() if graphs else None)


def decode_both_ways(runner_of: Callable[[], ModelRunner], lengths: list[int], steps: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy steps over prompts of `lengths` with rows written afresh from page lists at every
    step, and with persistent rows (fresh runners): the logits of every step, [steps, bs, V]
    each, on the host."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
    results = []
    for persistent in (False, True):
        runner = runner_of()
        tables, seqs, nxt = [], [], 1
        for p in prompts:
            pages = list(range(nxt, nxt + cdiv(len(p) + steps, PAGE)))
            nxt += len(pages)
            tables.append(pages)
            seqs.append([*p, int(runner.prefill(p, pages, pages).argmax())])
        slots = runner.new_inputs(len(prompts) + 1)
        ids = [slots.acquire() for _ in prompts]
        for slot, pages, s in zip(ids, tables, seqs, strict=True):
            slots.write_full(slot, 0, pages)
            slots.write_swa(slot, 0, pages[:(len(s) - 1) // PAGE + 1])  # up to the position
            slots.write_token(slot, s[-1])
        out = []
        for _ in range(steps):
            positions = [len(s) - 1 for s in seqs]
            if persistent:
                for slot, pages, pos in zip(ids, tables, positions, strict=True):
                    if pos % PAGE == 0:  # a new page: the daemon writes it when it is added
                        slots.write_swa(slot, pos // PAGE, [pages[pos // PAGE]])
                logits, slots_t = runner.decode_rows(slots, ids, positions)
                chosen = logits.argmax(-1)
                slots.tokens[slots_t] = chosen  # the next step reads these on the device
                out.append(logits.clone())
            else:
                out.append(decode_lists(runner, [s[-1] for s in seqs], positions, tables,
                                        tables))
                chosen = out[-1].argmax(-1)
            for s, t in zip(seqs, chosen.tolist(), strict=True):
                s.append(t)
        results.append(torch.stack(out).cpu())
    return results[0], results[1]


@pytest.mark.parametrize("graphs", [False, True])
def test_persistent_rows_equal_rows_written_afresh(model: GptOssModel, graphs: bool) -> None:
    """Three requests (one past the 127-token window) decode 20 greedy steps both ways; the
    persistent rows get their tokens from the device buffer only (written by the 'sampler')
    and their SWA pages as they are reached, as the daemon writes them."""
    fresh, kept = decode_both_ways(lambda: runner_for(model, graphs), [5, 60, 140], 20)
    torch.testing.assert_close(kept, fresh, atol=1e-5, rtol=0)


def test_slots_refuse_bad_page_ids_and_reuse_released_rows(model: GptOssModel) -> None:
    runner = runner_for(model, False)
    slots = runner.new_inputs(2)
    a, b = slots.acquire(), slots.acquire()
    assert {a, b} == {1, 2}  # row 0 is the dummy row
    with pytest.raises(PageError, match="every row"):
        slots.acquire()
    slots.write_full(b, 0, [7])  # a good write flushed with a bad one: neither is applied
    for write, why in [(lambda: slots.write_full(a, 0, [1, 161]), "full page ids"),
                       (lambda: slots.write_swa(a, 0, [-1]), "swa page ids"),
                       (lambda: slots.write_full(a, runner.max_pages, [1]), "past the table"),
                       (lambda: slots.write_full(a, 0, [1] * 17 + [999]), "full page ids")]:
        write()
        with pytest.raises(PageError, match=why):
            slots.flush()
    assert not slots.full.any() and not slots.swa.any()
    slots.flush()  # the refused writes are gone
    slots.release(a)
    assert slots.acquire() == a
    slots.write_swa(b, 0, list(range(1, 21)))  # 20 pages: only the last `ring` are kept
    slots.flush()
    ring = slots.ring
    assert sorted(slots.swa[b].tolist()) == list(range(21 - ring, 21))
    assert slots.swa[b, 19 % ring] == 20 and not slots.full[0].any() and not slots.swa[0].any()


def test_a_flush_applies_the_last_write_of_an_entry_written_twice(model: GptOssModel) -> None:
    """A freed row reused in the same step, an SWA ring column written for two pages: the
    entry ends with the value queued last (a scatter with repeated indices is unordered on
    CUDA, so the flush drops the earlier writes)."""
    slots = runner_for(model, False).new_inputs(2)
    row = slots.acquire()
    slots.write_swa(row, 0, [5])
    slots.write_full(row, 3, [4])
    slots.write_token(row, 11)
    slots.write_swa(row, slots.ring, [9])  # the same ring column as page 0
    slots.write_full(row, 3, [6])
    slots.write_token(row, 12)
    slots.flush()
    assert slots.swa[row, 0] == 9 and slots.full[row, 3] == 6 and slots.tokens[row] == 12
