"""The test fault points of the decode daemon: armed only from `DW_TEST_FAULTS`, a bad value is
a start-up error naming the variable, and nothing is armed without it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from decode_worker.daemon.decode.faults import ENV, arm_test_faults, parse_faults
from decode_worker.errors import ConfigError


def engine(host: bool = True) -> Any:
    pool = SimpleNamespace(fail_restores=0)
    return SimpleNamespace(host_tier=SimpleNamespace(pool=pool) if host else None)


def test_fail_restores_arms_the_host_pools_fault_point() -> None:
    e = engine()
    assert arm_test_faults(e, {ENV: "fail_restores=2"}) == {"fail_restores": 2}
    assert e.host_tier.pool.fail_restores == 2


def test_nothing_is_armed_without_the_variable() -> None:
    e = engine()
    assert arm_test_faults(e, {}) == {} and e.host_tier.pool.fail_restores == 0
    assert arm_test_faults(engine(host=False), {ENV: ""}) == {}


@pytest.mark.parametrize("value", ["fail_restores", "fail_restores=x", "drop_pages=1",
                                   "fail_restores=-1"])
def test_a_bad_value_names_the_variable(value: str) -> None:
    with pytest.raises(ConfigError, match=ENV):
        parse_faults(value)


def test_fail_restores_without_a_host_tier_is_refused() -> None:
    with pytest.raises(ConfigError, match="host tier"):
        arm_test_faults(engine(host=False), {ENV: "fail_restores=1"})
