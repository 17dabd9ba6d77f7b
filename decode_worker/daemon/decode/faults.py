"""Fault points armed for tests from the environment, never from the network.

`DW_TEST_FAULTS="fail_restores=N"` (comma-separated `name=count` pairs) arms the engine's fault
points at start-up: `fail_restores` makes the next N host -> device restores fail
(`HostKVPool.fail_restores`), so a live test can see what a client gets when a restore fails.
The variable sits outside the `DECODE_WORKER_` settings prefix on purpose: it is no setting, it
is not documented for operators, and each armed point is logged as a warning. Unset (always, in
production) it does nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from decode_worker.daemon.decode.engine import DecodeEngine
from decode_worker.errors import ConfigError

log = logging.getLogger(__name__)
ENV = "DW_TEST_FAULTS"
KNOWN = ("fail_restores",)


def parse_faults(text: str) -> dict[str, int]:
    """`name=count,...` -> {name: count}; ConfigError naming the variable on anything else."""
    out: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, count = item.partition("=")
        if name not in KNOWN or not sep or not count.isdigit():
            raise ConfigError(f"{ENV}: {item!r} is not one of {', '.join(KNOWN)} as name=count")
        out[name] = int(count)
    return out


def arm_test_faults(engine: DecodeEngine, env: Mapping[str, str]) -> dict[str, int]:
    """Arm the fault points `env[ENV]` names (before the engine starts); returns them."""
    faults = parse_faults(env.get(ENV, ""))
    restores = faults.get("fail_restores", 0)
    if restores:
        if engine.host_tier is None:
            raise ConfigError(f"{ENV}: fail_restores needs the host tier "
                              "(cache.hierarchical_cache)")
        engine.host_tier.pool.fail_restores = restores
    for name, count in faults.items():
        log.warning("test fault point armed: %s=%d (%s)", name, count, ENV)
    return faults
