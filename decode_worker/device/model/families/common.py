"""What every family reads the same way from config.json: typed fields that name themselves
when missing or invalid, the EOS ids, the dtype, FP8 block quantization, and the `Family`
record the registry lists."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from decode_worker.device.model.arch import FULL, SLIDING
from decode_worker.device.model.base import ArchFacts
from decode_worker.errors import ConfigError

_MISSING = object()


@dataclass(frozen=True, slots=True)
class Family:
    """One supported architecture family: how it is recognised, what it reads, how a tiny
    random model of it is described (`tiny_config`: a config.json in the hub's keys)."""

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    reads: tuple[str, ...]
    read_config: Callable[[dict[str, Any], str], ArchFacts]
    tiny_config: Callable[[int], dict[str, Any]]
    example: str = ""
    kv_layout: str = "full pool only"
    backends: tuple[str, ...] = ("torch", "triton attention")
    protocols: tuple[str, ...] = ("native", "sglang")  # prefill protocols that serve it


class Fields:
    """Typed access to a config.json object; every error names the field and the file."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw, self.source = raw, source

    def _get(self, key: str, default: Any) -> Any:
        value = self.raw.get(key)
        if value is None:
            if default is _MISSING:
                raise ConfigError(f"{self.source}: config field {key!r} is missing")
            return default
        return value

    def integer(self, key: str, default: Any = _MISSING, *, minimum: int = 1) -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{self.source}: config field {key!r} must be an integer >= "
                              f"{minimum}, got {value!r}")
        return value

    def number(self, key: str, default: Any = _MISSING) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{self.source}: config field {key!r} must be a number, "
                              f"got {value!r}")
        return float(value)

    def optional_float(self, key: str) -> float | None:
        return None if self.raw.get(key) is None else self.number(key)

    def flag(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.source}: config field {key!r} must be true or false, "
                              f"got {value!r}")
        return value

    def int_list(self, key: str) -> list[int]:
        value = self._get(key, [])
        if not isinstance(value, list) or any(not isinstance(v, int) for v in value):
            raise ConfigError(f"{self.source}: config field {key!r} must be a list of "
                              f"integers, got {value!r}")
        return list(value)

    def layer_types(self, default: list[str]) -> tuple[str, ...]:
        """transformers 5's `layer_types` when given, else `default` (the hub's rule)."""
        value = self.raw.get("layer_types")
        if value is None:
            return tuple(default)
        if not isinstance(value, list) or any(t not in (FULL, SLIDING) for t in value):
            raise ConfigError(f"{self.source}: config field 'layer_types' may hold only "
                              f"{FULL!r} and {SLIDING!r}")
        return tuple(value)

    def expect(self, key: str, allowed: tuple[Any, ...], default: Any) -> Any:
        """A field that must hold one of `allowed` (what this worker implements)."""
        value = self.raw.get(key, default)
        if value not in allowed:
            raise ConfigError(f"{self.source}: config field {key!r}={value!r} is not supported "
                              f"(supported: {', '.join(repr(a) for a in allowed)})")
        return value

    def eos_ids(self) -> tuple[int, ...]:
        eos = self.raw.get("eos_token_id")
        if eos is None:
            return ()
        if isinstance(eos, int):
            return (eos,)
        if isinstance(eos, list) and all(isinstance(e, int) for e in eos):
            return tuple(eos)
        raise ConfigError(f"{self.source}: config field 'eos_token_id' must be an integer or "
                          f"a list of them, got {eos!r}")

    def torch_dtype(self) -> str | None:
        value = self.raw.get("torch_dtype") or self.raw.get("dtype")
        return str(value) if value is not None else None

    def fp8_block(self) -> tuple[int, int] | None:
        """`quantization_config` of an FP8 block-quantized checkpoint -> its block shape;
        None without quantization. Raises ConfigError for another method or block form."""
        q = self.raw.get("quantization_config")
        if q is None:
            return None
        method = q.get("quant_method") if isinstance(q, dict) else None
        if method != "fp8":
            raise ConfigError(f"{self.source}: quantization_config.quant_method={method!r} is "
                              "not supported (supported: 'fp8' with weight_block_size)")
        block = q.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2
                and all(isinstance(b, int) and b > 0 for b in block)):
            raise ConfigError(f"{self.source}: quantization_config.weight_block_size must be "
                              f"[rows, cols], got {block!r}")
        return block[0], block[1]
