"""SGLang's `--kv-events-config` JSON (sglang 0.5.23 `KVEventsConfig`), parsed once, at load.

Same keys and defaults as SGLang: `publisher` ("null" = no socket, the default; "zmq"), `endpoint`
(`tcp://*:5557`), `bind` (None: bind wildcard/ipc/inproc endpoints, connect otherwise),
`replay_endpoint`, `buffer_steps`, `hwm`, `max_queue_size`, `topic`, `format`. Unlike SGLang, a
bad value or an unknown key stops the daemon with one line naming the key (SGLang fails later,
or ignores unknown keys); `format` "dynamo" only changes namespaced (salted/LoRA) hashes, which
this worker never has, so both formats publish the same hashes. Unset, a decode worker with
its gRPC port on still keeps the event log for SubscribeKvEvents
(`KvEventsSettings.keeps_event_log`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from decode_worker.errors import ConfigError


class KvEventsConfig(BaseModel):
    """One publisher's configuration (see module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    publisher: Literal["null", "zmq"] = "null"
    endpoint: str = "tcp://*:5557"
    bind: bool | None = None
    replay_endpoint: str | None = None
    buffer_steps: int = Field(10_000, gt=0)
    hwm: int = Field(100_000, ge=0)
    max_queue_size: int = Field(100_000, gt=0)
    topic: str = ""
    format: Literal["default", "dynamo"] = "default"

    @property
    def enabled(self) -> bool:
        return self.publisher == "zmq"

    def should_bind(self) -> bool:
        """SGLang's rule: `bind` if set, else bind wildcard, ipc:// and inproc:// endpoints."""
        if self.bind is not None:
            return self.bind
        ep = self.endpoint
        return ("*" in ep or "::" in ep or "0.0.0.0" in ep
                or ep.startswith(("ipc://", "inproc://")))


def parse_kv_events_config(raw: str | dict[str, Any] | None,
                           where: str = "kv_events.config") -> KvEventsConfig:
    """Parse the JSON text (or an already parsed object); '' / None: publishing off.
    Raises `ConfigError` naming `where` and the bad key."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return KvEventsConfig()
    try:
        data = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON ({exc.msg} at char {exc.pos})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(data).__name__}")
    try:
        return KvEventsConfig.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "?"
        if err["type"] == "extra_forbidden":
            allowed = ", ".join(KvEventsConfig.model_fields)
            raise ConfigError(f"{where}: unknown key {key!r} (keys: {allowed})") from None
        value = data.get(key, "<missing>")
        raise ConfigError(f"{where}: key {key!r}={value!r}: {err['msg']}") from None
