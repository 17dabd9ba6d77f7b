"""Tokenizer: a thin wrapper over `tokenizers` (tokenizer.json) plus the chat template.

Chat template: when the model directory ships one (`chat_template.jinja`, or `chat_template` in
tokenizer_config.json) and jinja2 is importable, it is rendered with `messages` (each message's
own keys too: `tool_calls`, `tool_call_id`, `name`, `reasoning_content`), `tools` (OpenAI's
function tools, when given), `add_generation_prompt`, `bos_token` and `eos_token` in a sandbox
(with `raise_exception`, `strftime_now`, transformers' `tojson` filter and jinja's loop
controls, as transformers provides; a template error is a ClientError). `strftime_now` formats
the `start_date` the caller pins (midnight of that day; the API passes `api.system_start_date`,
so both P/D legs render the same date) or, without one, the local time now; `reasoning_effort`,
when given, is a template variable (gpt-oss). gpt-oss templates and the built-in tiny model's
(`harmony_template.py`) render the harmony format, tools included. Otherwise the built-in
template is used (it renders no tools):

    <|start|>{role}<|message|>{content}<|end|>   (one per message)
    <|start|>assistant<|message|>                (if add_generation_prompt)
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from decode_worker.errors import ClientError, ConfigError

BUILTIN_CHAT_TEMPLATE = (
    "{%- for m in messages -%}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|start|>assistant<|message|>{%- endif -%}"
)


class Tokenizer:
    """Text <-> token ids. Thread-safe for encode/decode (the Rust tokenizer is)."""

    def __init__(self, inner: HFTokenizer, eos_token_ids: Sequence[int] = (),
                 chat_template: str | None = None, special: dict[str, str] | None = None,
                 model_vocab_size: int | None = None) -> None:
        """`model_vocab_size`: config.json's `vocab_size` (the embedding's rows), which may
        exceed the tokenizer's own size (Qwen3: 151,936 rows, 151,669 tokens)."""
        self.inner = inner
        self.model_vocab_size = model_vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template
        self.special = special or {}
        self._compiled: Any = None

    @classmethod
    def from_dir(cls, model_dir: Path) -> Tokenizer:
        """Load tokenizer.json (+ optional tokenizer_config.json, generation_config.json,
        config.json for the eos ids, chat_template.jinja). Raises ConfigError if missing."""
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"{model_dir}: no tokenizer.json")
        inner = HFTokenizer.from_file(str(path))
        tok_cfg = _read_json(Path(model_dir) / "tokenizer_config.json")
        template = tok_cfg.get("chat_template")
        jinja_file = Path(model_dir) / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text()
        special = {k: v for k in ("bos_token", "eos_token")
                   if isinstance(v := tok_cfg.get(k), str)}
        eos = _eos_ids(Path(model_dir), inner, special.get("eos_token"))
        rows = _model_config(Path(model_dir)).get("vocab_size")
        return cls(inner, eos, template if isinstance(template, str) else None, special,
                   rows if isinstance(rows, int) and rows > 0 else None)

    @property
    def vocab_size(self) -> int:
        """The tokenizer's own size (added tokens included)."""
        return int(self.inner.get_vocab_size(with_added_tokens=True))

    @property
    def input_vocab_size(self) -> int:
        """What input ids are checked against, as SGLang checks them: the model's embedding
        rows when config.json states them, else the tokenizer's size."""
        return self.model_vocab_size or self.vocab_size

    def encode(self, text: str) -> list[int]:
        """Text -> ids, special-token strings in the text are recognised, no BOS added."""
        return list(self.inner.encode(text, add_special_tokens=False).ids)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token's text (a special token such as `<|channel|>`), or None."""
        tid = self.inner.token_to_id(token)
        return None if tid is None else int(tid)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids -> text (ids outside the vocabulary are dropped)."""
        return str(self.inner.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: Sequence[dict[str, Any]] | None = None, *,
                            start_date: datetime.date | None = None,
                            reasoning_effort: str | None = None) -> str:
        """Render a chat (a list of {"role", "content", ...}) and its tools to prompt text.
        See the module doc."""
        if self.chat_template is not None:
            extra: dict[str, Any] = {}
            if start_date is not None:
                extra["strftime_now"] = _pinned_strftime(start_date)
            if reasoning_effort is not None:
                extra["reasoning_effort"] = reasoning_effort
            rendered = self._render(self.chat_template, messages, add_generation_prompt, tools,
                                    extra)
            if rendered is not None:
                return rendered
        parts = [f"<|start|>{m['role']}<|message|>{_content(m)}<|end|>" for m in messages]
        if add_generation_prompt:
            parts.append("<|start|>assistant<|message|>")
        return "".join(parts)

    def _render(self, template: str, messages: Sequence[dict[str, Any]],
                add_generation_prompt: bool, tools: Sequence[dict[str, Any]] | None = None,
                extra: dict[str, Any] | None = None) -> str | None:
        try:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            return None
        try:
            if self._compiled is None:
                env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=["jinja2.ext.loopcontrols"])
                env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
                env.filters["tojson"] = _tojson
                self._compiled = env.from_string(template)
            return str(self._compiled.render(
                messages=[{**m, "content": _content(m)} for m in messages],
                add_generation_prompt=add_generation_prompt,
                tools=list(tools) if tools else None, **self.special, **(extra or {})))
        except jinja2.TemplateError as exc:
            raise ClientError(f"chat template: {exc}") from None


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' `tojson` (the filter its chat templates are written for): keys in their
    order, no HTML escaping, non-ASCII kept (jinja's own sorts keys and escapes `<>&'`)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise(message: str) -> None:
    """`raise_exception(...)` in a template: the chat is not valid for this model."""
    raise ClientError(f"chat template: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _pinned_strftime(day: datetime.date) -> Any:
    """`strftime_now` for a pinned date: midnight of `day` (a time of day could not be
    agreed between two servers anyway)."""
    start = datetime.datetime.combine(day, datetime.time())

    def strftime_now(fmt: str) -> str:
        return start.strftime(fmt)

    return strftime_now


def _content(message: dict[str, Any]) -> str:
    content = message.get("content") or ""
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from None
    return data if isinstance(data, dict) else {}


def _model_config(model_dir: Path) -> dict[str, Any]:
    """config.json, or a multimodal one's `text_config` (where its vocab_size lives)."""
    cfg = _read_json(model_dir / "config.json")
    text = cfg.get("text_config")
    return {**text, **cfg} if isinstance(text, dict) and "vocab_size" not in cfg else cfg


def _eos_ids(model_dir: Path, inner: HFTokenizer, eos_token: str | None) -> tuple[int, ...]:
    for name in ("generation_config.json", "config.json"):
        eos = _read_json(model_dir / name).get("eos_token_id")
        if isinstance(eos, int):
            return (eos,)
        if isinstance(eos, list) and eos:
            return tuple(int(e) for e in eos)
    if eos_token is not None and (tid := inner.token_to_id(eos_token)) is not None:
        return (int(tid),)
    return ()
