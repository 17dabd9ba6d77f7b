"""A simulated PD hand-off: prefill on one set of pools, copy page bytes the way a NIXL WRITE
does (by `region_offset` / `page_bytes`), decode on other pools with other page ids. Greedy
tokens and logits must match the reference (float32)."""

from __future__ import annotations

import pytest
import torch

from decode_worker.core.window import swa_window_start
from decode_worker.device.kv_pool import KVPools
from decode_worker.device.model.gpt_oss import GptOssModel
from decode_worker.utils.mathx import cdiv
from tests.decode_steps import decode_lists
from tests.oracle.helpers import reference_greedy
from tests.oracle.test_oracle_gpt_oss import LOGIT_ATOL, make_runner, prompt_of


def copy_pages(src: KVPools, dst: KVPools, pool: str, src_ids: list[int],
               dst_ids: list[int]) -> None:
    """Byte copy of whole pages (every layer of `pool`), like one descriptor per page."""
    s_bytes = src.tensor(pool).view(torch.uint8).reshape(-1)  # type: ignore[arg-type]
    d_bytes = dst.tensor(pool).view(torch.uint8).reshape(-1)  # type: ignore[arg-type]
    size = src.page_bytes(pool)  # type: ignore[arg-type]
    for layer in range(src.tensor(pool).shape[0]):  # type: ignore[arg-type]
        for s_id, d_id in zip(src_ids, dst_ids, strict=True):
            s_off = src.region_offset(pool, layer, s_id)  # type: ignore[arg-type]
            d_off = dst.region_offset(pool, layer, d_id)  # type: ignore[arg-type]
            d_bytes[d_off:d_off + size] = s_bytes[s_off:s_off + size]


@pytest.mark.parametrize(("seq_len", "page_size", "radix"),
                         [(200, 16, True), (300, 64, True), (150, 16, False), (90, 16, True)])
def test_prefill_here_decode_there_matches_reference(
        model: GptOssModel, reference, seq_len: int, page_size: int, radix: bool) -> None:
    steps, window = 6, model.cfg.window
    prompt = prompt_of(seq_len, seed=seq_len)
    num = cdiv(seq_len, page_size)
    start = swa_window_start(seq_len, window, page_size, radix) // page_size  # first SWA page
    prefill, decode = make_runner(model, page_size), make_runner(model, page_size)
    src_full = list(range(1, num + 1))
    src_swa = [0] * start + list(range(1, num - start + 1))  # the peer holds only the tail
    first = int(prefill.prefill(prompt, src_full, src_swa).argmax())
    dst_full = list(range(num + 40, 40, -1))[:num]  # other ids, in another order
    dst_swa = [0] * start + list(range(77, 77 + num - start))
    copy_pages(prefill.pools, decode.pools, "full", src_full, dst_full)
    copy_pages(prefill.pools, decode.pools, "swa", src_swa[start:], dst_swa[start:])
    tokens, logits, spare = [first], [], iter(range(200, 400))
    for step in range(steps - 1):
        pos = seq_len + step
        while len(dst_full) <= pos // page_size:
            dst_full.append(next(spare))
            dst_swa.append(next(spare))
        out = decode_lists(decode, [tokens[-1]], [pos], [dst_full], [dst_swa])[0]
        logits.append(out)
        tokens.append(int(out.argmax()))
    ref_tokens, ref_logits = reference_greedy(reference, prompt, steps)
    assert tokens == ref_tokens
    assert (torch.stack(logits) - ref_logits[1:]).abs().max().item() < LOGIT_ATOL
