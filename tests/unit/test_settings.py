"""Settings sources, precedence, errors and the `config` subcommand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from decode_worker.errors import ConfigError
from decode_worker.settings import load_settings


def test_precedence_default_toml_env_cli(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text("[cache]\npage_size = 32\n[server]\nport = 4000\nhost = '0.0.0.0'\n")
    env = {"DECODE_WORKER_SERVER__PORT": "5000", "DECODE_WORKER_CACHE__PAGE_SIZE": "64"}
    loaded = load_settings(toml, {"cache.page_size": 128}, env)
    s = loaded.settings
    assert (s.cache.page_size, s.server.port, s.server.host) == (128, 5000, "0.0.0.0")
    assert loaded.sources["cache.page_size"] == "cli"
    assert loaded.sources["server.port"] == "env"
    assert loaded.sources["server.host"] == f"file {toml}"
    assert loaded.sources["scheduler.max_running_requests"] == "default"


def test_unified_tree_plain_switches() -> None:
    assert load_settings(environ={}).settings.cache.unified_radix_tree is True
    off = load_settings(environ={"ENABLE_UNIFIED_RADIX_TREE": "0"}).settings
    assert off.cache.unified_radix_tree is False
    sg = load_settings(environ={"SGLANG_ENABLE_UNIFIED_RADIX_TREE": "false"}).settings
    assert sg.cache.unified_radix_tree is False
    ours = {"ENABLE_UNIFIED_RADIX_TREE": "1", "SGLANG_ENABLE_UNIFIED_RADIX_TREE": "0"}
    assert load_settings(environ=ours).settings.cache.unified_radix_tree is True
    explicit = {"ENABLE_UNIFIED_RADIX_TREE": "0", "DECODE_WORKER_CACHE__UNIFIED_RADIX_TREE": "1"}
    assert load_settings(environ=explicit).settings.cache.unified_radix_tree is True
    with pytest.raises(ConfigError, match="ENABLE_UNIFIED_RADIX_TREE='maybe'"):
        load_settings(environ={"ENABLE_UNIFIED_RADIX_TREE": "maybe"})


@pytest.mark.parametrize(
    ("environ", "needle"),
    [
        ({"DECODE_WORKER_CACHE__PAGE_SIZE": "abc"}, "DECODE_WORKER_CACHE__PAGE_SIZE='abc'"),
        ({"DECODE_WORKER_CACHE__PAGE_SIZE": "0"}, "greater than 0"),
        ({"DECODE_WORKER_CACHE__NOPE": "1"}, "unknown setting"),
        ({"DECODE_WORKER_BOGUS__X": "1"}, "DECODE_WORKER_BOGUS__X: unknown setting"),
        ({"DECODE_WORKER_PORT": "1"}, "DECODE_WORKER_PORT: unknown setting"),
        ({"DECODE_WORKER_MODEL__DTYPE": "int3"}, "'float32'"),
    ],
)
def test_invalid_values_name_key_value_and_allowed(environ: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(environ=environ)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_bad_toml_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[cache\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(bad, environ={})
    with pytest.raises(ConfigError, match=r"bogus.*unknown setting"):
        (tmp_path / "x.toml").write_text("[cache]\nbogus = 1\n")
        load_settings(tmp_path / "x.toml", environ={})


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "decode_worker", *args],
        capture_output=True, text=True, timeout=60, env=env,
    )


def test_config_command_reports_error_and_sources() -> None:
    import os

    base = {k: v for k, v in os.environ.items() if not k.startswith("DECODE_WORKER_")}
    bad = _cli("config", env={**base, "DECODE_WORKER_CACHE__PAGE_SIZE": "abc"})
    assert bad.returncode != 0
    assert len(bad.stderr.strip().splitlines()) == 1
    assert "DECODE_WORKER_CACHE__PAGE_SIZE" in bad.stderr
    ok = _cli(
        "config", env={**base, "ENABLE_UNIFIED_RADIX_TREE": "1",
                       "DECODE_WORKER_SERVER__API_KEY": "hunter2"},
    )
    assert ok.returncode == 0, ok.stderr
    assert "cache.unified_radix_tree" in ok.stdout and "= true  # env" in ok.stdout
    assert "hunter2" not in ok.stdout


def test_every_subcommand_has_help() -> None:
    for sub in ("serve", "prefill", "demo", "make-model", "config", "harmony-vocab"):
        out = _cli(sub, "--help")
        assert out.returncode == 0 and "usage:" in out.stdout, sub


def test_example_configs_load() -> None:
    root = Path(__file__).resolve().parents[2] / "configs"
    files = sorted(root.glob("*.toml"))
    assert len(files) >= 2
    for path in files:
        load_settings(path, environ={})
