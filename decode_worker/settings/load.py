"""Loading settings: merge defaults < TOML < environment < CLI overrides, remember where each
value came from, and turn validation errors into one line naming the key (see `sections` for
the sources and the keys)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_settings import EnvSettingsSource, TomlConfigSettingsSource

from decode_worker.errors import ConfigError
from decode_worker.settings.sections import ENV_PREFIX, UNIFIED_TREE_VARS, Settings

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class LoadedSettings(BaseModel):
    """Resolved settings plus, for every dotted key, where its value came from."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    settings: Settings
    sources: dict[str, str]


def load_settings(
    config_file: Path | None = None,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> LoadedSettings:
    """Merge defaults < TOML < environment < overrides and validate.

    Args:
        overrides: dotted keys (`"server.port"`) to values, from the CLI.
        environ: the environment to read (default `os.environ`).
    Raises:
        ConfigError: one line naming the key, where it came from, the value and what is allowed.
    """
    env = dict(os.environ if environ is None else environ)
    layers: list[tuple[str, dict[str, Any]]] = []
    if config_file is not None:
        layers.append((f"file {config_file}", _read_toml(config_file)))
    layers.append(("env", _read_env(env)))
    layers.append(("cli", _nest(overrides or {})))
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, layer in layers:
        for key, value in _flatten(layer).items():
            sources[key] = name
            _set_dotted(merged, key, value)
    try:
        settings = Settings(**merged)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, sources, merged)) from None
    for key in _flatten(settings.model_dump()):
        sources.setdefault(key, "default")
    return LoadedSettings(settings=settings, sources=dict(sorted(sources.items())))


def env_var_name(dotted_key: str) -> str:
    """`cache.page_size` -> `DECODE_WORKER_CACHE__PAGE_SIZE`."""
    section, _, key = dotted_key.partition(".")
    return f"{ENV_PREFIX}{section.upper()}__{key.upper()}"


def parse_bool(name: str, raw: str) -> bool:
    """Parse an operator's on/off switch; raises ConfigError naming the variable."""
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r}: expected one of 1/true/yes/on or 0/false/no/off")


def _read_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        return dict(TomlConfigSettingsSource(Settings, toml_file=path)())
    except ValueError as exc:  # tomllib.TOMLDecodeError is a ValueError
        raise ConfigError(f"--config {path}: not valid TOML: {exc}") from None


def _read_env(env: dict[str, str]) -> dict[str, Any]:
    source = EnvSettingsSource(
        Settings, env_prefix=ENV_PREFIX, env_nested_delimiter="__", case_sensitive=False
    )
    source.env_vars = {k.lower(): v for k, v in env.items()}
    sections = set(Settings.model_fields)
    for name in env:
        if name.upper().startswith(ENV_PREFIX):
            section, sep, key = name[len(ENV_PREFIX):].partition("__")
            if section.lower() not in sections or not sep or not key:
                raise ConfigError(f"{name}: unknown setting (expected {ENV_PREFIX}<SECTION>__<KEY>"
                                  f" with SECTION one of {', '.join(sorted(sections))})")
    values = dict(source())
    explicit = f"{ENV_PREFIX}CACHE__UNIFIED_RADIX_TREE".lower()
    if explicit not in source.env_vars:
        # Plain operator switches: ours first, then the name operators bring from SGLang.
        for name in UNIFIED_TREE_VARS:
            if name in env:
                cache = dict(values.get("cache", {}))
                cache["unified_radix_tree"] = parse_bool(name, env[name])
                values["cache"] = cache
                break
    return values


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and "." not in dotted:
            flat.update(_flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        if "." not in key:
            raise ConfigError(f"override {key!r}: expected section.key=value")
        _set_dotted(nested, key, value)
    return nested


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    section, _, key = dotted.partition(".")
    node = tree.setdefault(section, {})
    if not isinstance(node, dict):
        raise ConfigError(f"{section}: expected a section, got {node!r}")
    node[key] = value


def _describe(exc: ValidationError, sources: dict[str, str], merged: dict[str, Any]) -> str:
    err = exc.errors()[0]
    dotted = ".".join(str(p) for p in err["loc"][:2])
    source = sources.get(dotted, "default")
    where = {"env": env_var_name(dotted), "cli": f"--set {dotted}"}.get(source, dotted)
    if source.startswith("file "):
        where = f"{dotted} (in {source[5:]})"
    value = _flatten(merged).get(dotted, "<missing>")
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown setting (see `decode-worker config` for the valid keys)"
    return f"{where}={value!r}: {err['msg']}"
