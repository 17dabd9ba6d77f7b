"""The host tier on CUDA: `HostKVPool` writes (device -> pinned host, on its own stream) and
restores (pinned host -> device, on its own stream) while CUDA-graph decode steps run on the
compute stream; the copied pages are bit-equal, a page reused right after its write-back
still reaches the host as it was, and the decode steps' logits equal those of a run without
copies (needs CUDA; auto-skipped).

Run on a GPU machine: `python -m pytest -q tests/gpu/test_host_tier_cuda.py`.
"""

from __future__ import annotations

import pytest
import torch

from decode_worker.core.host_tier import HostRestore, HostWrite
from decode_worker.device.default_model import write_model
from decode_worker.device.host_pool import HostKVPool
from decode_worker.device.kv_pool import KVPools, KVSpec
from decode_worker.device.model.gpt_oss import GptOssModel
from decode_worker.device.model.weights import load_model
from decode_worker.device.runner import ModelRunner
from decode_worker.utils.mathx import cdiv
from tests.decode_steps import decode_lists

pytestmark = pytest.mark.gpu

PAGE, STEPS = 16, 8
LENGTHS = [200, 301, 77]  # prompts; decode pages follow each prompt's pages
SPARE = 400  # device pages from here on are never touched by the decode steps


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> GptOssModel:
    d = write_model(tmp_path_factory.mktemp("m"), seed=0)
    return load_model(d, "cuda", torch.float32)


def _runner(model: GptOssModel) -> ModelRunner:
    pools = KVPools(KVSpec.from_config(model.cfg), 512, 512, PAGE, "cuda", torch.float32)
    return ModelRunner(model, pools, use_cuda_graph=True, graph_batch_sizes=[1, 2, 4],
                       max_graph_pages=32)


def _prefill(runner: ModelRunner) -> tuple[list[list[int]], list[list[int]]]:
    """Random prompts on pages 1..; returns (token lists with the first sampled token, page
    tables covering the decode steps too)."""
    gen = torch.Generator().manual_seed(0)
    seqs, tables, nxt = [], [], 1
    for n in LENGTHS:
        pages = list(range(nxt, nxt + cdiv(n + STEPS, PAGE)))
        nxt += len(pages)
        prompt = torch.randint(0, 256, (n,), generator=gen).tolist()
        seqs.append([*prompt, int(runner.prefill(prompt, pages, pages).argmax())])
        tables.append(pages)
    assert nxt < SPARE
    return seqs, tables


def _step(runner: ModelRunner, seqs: list[list[int]], tables: list[list[int]]) -> torch.Tensor:
    logits = decode_lists(runner, [s[-1] for s in seqs], [len(s) - 1 for s in seqs], tables,
                          tables)  # [bs, V]
    for s, row in zip(seqs, logits, strict=True):
        s.append(int(row.argmax()))
    return logits


def test_copies_on_their_streams_are_bit_equal_while_graph_steps_run(model: GptOssModel) -> None:
    reference = _runner(model)
    seqs, tables = _prefill(reference)
    want = torch.stack([_step(reference, seqs, tables) for _ in range(STEPS)])
    reference.destroy()

    runner = _runner(model)
    pools = runner.pools
    host = HostKVPool(pools, 64)
    assert host.host.is_pinned() and host.is_cuda
    seqs, tables = _prefill(runner)
    # whole prompt pages: read by attention, never written by the decode steps
    stable = [p for t, n in zip(tables, LENGTHS, strict=True) for p in t[: n // PAGE]][:24]
    snap = pools.full[:, stable].clone()  # [L, n, 2, ps, H, D]
    spare = list(range(SPARE, SPARE + 8))
    pools.full[:, spare] = torch.randn_like(pools.full[:, spare])
    spare_snap = pools.full[:, spare].clone()
    got, handle = [], None
    for step in range(STEPS):
        if step == 1:  # write-through of prompt pages, while the steps read them
            host.write(HostWrite(stable, list(range(1, 1 + len(stable)))))
        if step == 2:  # write-back: the pages are reused on the compute stream right after
            host.write(HostWrite(spare, list(range(40, 48))))
            pools.full[:, spare] = 0.0
        if step == 4:  # restore into free pages, on the restore stream
            handle = host.restore(HostRestore(list(range(1, 1 + len(stable))),
                                              list(range(SPARE + 16, SPARE + 16 + len(stable)))))
        got.append(_step(runner, seqs, tables))
    assert handle is not None
    handle.event.synchronize()  # type: ignore[union-attr]
    torch.cuda.synchronize()
    assert handle.is_done()
    restored = pools.full[:, list(range(SPARE + 16, SPARE + 16 + len(stable)))]
    assert torch.equal(restored, snap)
    assert torch.equal(host.host[:, list(range(40, 48))], spare_snap.cpu())
    assert not pools.full[:, spare].any()
    assert (torch.stack(got) - want).abs().max().item() < 1e-4  # the copies changed no step
    assert runner.graphs is not None and runner.graphs.graphs
    runner.destroy()


def test_a_transfer_waits_only_for_the_writes_that_read_its_pages(model: GptOssModel) -> None:
    """`sync_writes_reading`: once it returns for pages A, the write reading A is in host
    memory (a NIXL transfer may land in A); asking for pages no write reads never waits."""
    pools = KVPools(KVSpec.from_config(model.cfg), 512, 512, PAGE, "cuda", torch.float32)
    host = HostKVPool(pools, 256)
    a, b = list(range(1, 129)), list(range(200, 328))
    pools.full[:, a + b] = torch.randn_like(pools.full[:, a + b])
    want_a = pools.full[:, a].cpu()
    host.write(HostWrite(a, list(range(1, 129))))
    host.sync_writes_reading(b)  # no write reads b: no wait, whatever the stream's state
    assert host.write_waits_total == 0
    host.sync_writes_reading(a)
    assert host.write_waits_total <= 1  # 1 when the write was still in flight
    assert torch.equal(host.host[:, list(range(1, 129))], want_a)  # landed before the return
    pools.full[:, a] = 0.0  # what a transfer landing in `a` would do: the host copy stays
    torch.cuda.synchronize()
    assert torch.equal(host.host[:, list(range(1, 129))], want_a)
    host.sync_writes()
