"""The NIXL agent wrapper with real NIXL (UCX): registration the backend refuses stops startup
with the fix named; an idle agent does not spin a core."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from decode_worker.core.types import MemoryRegion
from decode_worker.errors import ConfigError
from decode_worker.io.kv.nixl_agent import NixlAgent, unique_agent_name
from decode_worker.settings import TransferSettings

DELAY_US = TransferSettings().progress_delay_us


def test_gpu_pools_on_a_backend_without_cuda_are_refused_with_the_fix() -> None:
    """Host memory declared as VRAM is what a UCX without CUDA support sees for GPU pools."""
    agent = NixlAgent(unique_agent_name("test"), "UCX", DELAY_US)
    host = torch.zeros(1 << 16, dtype=torch.uint8)
    try:
        agent.register([MemoryRegion(host.data_ptr(), host.numel(), 0, "DRAM")])  # accepted
        with pytest.raises(ConfigError, match="VRAM") as err:
            agent.register([MemoryRegion(host.data_ptr(), host.numel(), 0, "VRAM")])
        assert "model.device = 'cpu'" in str(err.value) and "CUDA support" in str(err.value)
        assert len(agent._registered) == 1  # the DRAM registration stays, nothing half-done
    finally:
        agent.close()


_IDLE_CPU = """
import sys, time
from decode_worker.io.kv.nixl_agent import NixlAgent
agent = NixlAgent("idle-probe", "UCX", int(sys.argv[1]))
t0, c0 = time.monotonic(), time.process_time()
time.sleep(1.0)
print((time.process_time() - c0) / (time.monotonic() - t0))
"""


def idle_cpu_per_s(delay_us: int) -> float:
    """CPU-seconds per second of a fresh process holding one idle agent."""
    out = subprocess.run([sys.executable, "-c", _IDLE_CPU, str(delay_us)], capture_output=True,
                         text=True, timeout=60, check=True)
    return float(out.stdout.split()[-1])


def test_an_idle_agent_leaves_the_cpu_alone() -> None:
    """nixl's own default (delay 0) spins its progress thread at ~1 CPU-second per second with
    nothing to move; with the default setting the idle agent sleeps between polls (~0.03)."""
    assert idle_cpu_per_s(DELAY_US) < 0.3
