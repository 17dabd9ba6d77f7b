"""Registration the NIXL backend refuses stops startup with the fix named (real NIXL, UCX)."""

from __future__ import annotations

import pytest
import torch

from decode_worker.core.types import MemoryRegion
from decode_worker.errors import ConfigError
from decode_worker.io.nixl_agent import NixlAgent, unique_agent_name


def test_gpu_pools_on_a_backend_without_cuda_are_refused_with_the_fix() -> None:
    """Host memory declared as VRAM is what a UCX without CUDA support sees for GPU pools."""
    agent = NixlAgent(unique_agent_name("test"))
    host = torch.zeros(1 << 16, dtype=torch.uint8)
    try:
        agent.register([MemoryRegion(host.data_ptr(), host.numel(), 0, "DRAM")])  # accepted
        with pytest.raises(ConfigError, match="VRAM") as err:
            agent.register([MemoryRegion(host.data_ptr(), host.numel(), 0, "VRAM")])
        assert "model.device = 'cpu'" in str(err.value) and "CUDA support" in str(err.value)
        assert len(agent._registered) == 1  # the DRAM registration stays, nothing half-done
    finally:
        agent.close()
