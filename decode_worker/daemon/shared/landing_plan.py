"""The landing area's size and memory (a decode worker of a model SGLang lays out with full KV in
every layer, fed by SGLang prefills; docs/DEPLOY.md, "Gemma 3 and a stock SGLang prefill"):
how many pages `transfer.sglang_landing_tokens` asks for, the pool budget left beside them, and
the allocation, refused in one line when the device has no room."""

from __future__ import annotations

import logging

import torch

from decode_worker.core.memory_budget import MemoryBudgetError, gib
from decode_worker.device.gpu_memory import DeviceMemory
from decode_worker.device.kv_pool import KVPools, KVSpec
from decode_worker.device.landing import LandingArea
from decode_worker.settings import Settings
from decode_worker.utils.mathx import cdiv

log = logging.getLogger(__name__)


def allocate_landing(pools: KVPools, num_pages: int, memory: DeviceMemory | None,
                     model_type: str) -> LandingArea | None:
    """The landing area (None for 0 pages), or a ConfigError naming the setting when the device
    has no room for it (explicit pool sizes leave its bytes to the operator)."""
    if not num_pages:
        return None
    need = (num_pages + 1) * len(pools.spec.layer_types) * pools.page_bytes("full")
    if memory is not None and need > memory.mem_get_info()[0]:
        raise MemoryBudgetError(
            f"landing area of {num_pages} pages needs {gib(need)}, the device has "
            f"{gib(memory.mem_get_info()[0])} free; lower transfer.sglang_landing_tokens")
    log.info("landing area for SGLang prefills (full KV in every layer of %s): %d pages of %d "
             "tokens, %s", model_type, num_pages, pools.page_size, gib(need))
    return LandingArea(pools, num_pages)


def budget_less_landing(budget: int | None, num_landing: int, settings: Settings,
                        spec: KVSpec, device: torch.device, kv_dtype: torch.dtype) -> int | None:
    """The pools' derived budget less the landing area's bytes (None: explicit sizes)."""
    if not num_landing:
        return budget
    c = settings.cache
    if budget is None and device.type != "cuda":
        budget = c.cpu_pool_bytes
    page = len(spec.layer_types) * spec.page_bytes(c.page_size, kv_dtype, "full")
    return None if budget is None else budget - (num_landing + 1) * page


def landing_pages(settings: Settings, sglang_ordinary: bool) -> int:
    """Landing pages a decode worker holds for SGLang prefills of a model they lay out with
    full KV in every layer (`sglang_ordinary`): `transfer.sglang_landing_tokens` in pages; 0
    when no such prefill can feed it (`peer_protocol` native) or the setting is 0."""
    t = settings.transfer
    if not sglang_ordinary or t.peer_protocol == "native":
        return 0
    return cdiv(t.sglang_landing_tokens, settings.cache.page_size)
