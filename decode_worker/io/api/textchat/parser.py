"""A streaming parser for text-marker formats (Qwen3, Llama 3.x) with `HarmonyParser`'s
interface: `push(ids)` returns what a step added (`Delta`s), `finish()` ends the output,
`parsed` holds everything so far.

Each step re-parses the whole output text (`formats.parse_text`) and emits what grew. What a
later token could still change is held back: a trailing prefix of a marker (`<thi`), trailing
whitespace (content before a `<tool_call>` is stripped), an unclosed tool-call block, and for
Llama 3 text that starts with `{` (a call, or not, once it ends). Tool calls are emitted whole
(name, then the arguments in one piece) once closed (Qwen: `</tool_call>`; Llama: at the end).
At the end the whole output is parsed once more (`parse_text`), so a stream and a whole parse
give the same calls; the texts agree up to that held-back whitespace.
"""

from __future__ import annotations

from collections.abc import Sequence

from decode_worker.io.api.backend import Tokenizer
from decode_worker.io.api.harmony.parser import Delta, Parsed, new_call_id
from decode_worker.io.api.textchat.formats import THINK, TextFormat, parse_text, split_reasoning


class TextChatParser:
    """One sample's output, parsed as it streams (see the module doc)."""

    def __init__(self, fmt: TextFormat, tokenizer: Tokenizer, *, reasoning: bool,
                 parse_calls: bool, names: set[str] | None = None,
                 eos_ids: Sequence[int] = ()) -> None:
        self.fmt, self.tokenizer = fmt, tokenizer
        self.reasoning, self.calls, self.names = reasoning, parse_calls, names
        self.eos_ids = frozenset(eos_ids)
        self.ids: list[int] = []
        self.parsed = Parsed()
        self.num_reasoning_tokens = 0  # tokens pushed while a <think> block was open
        self._sent_calls = 0

    def text(self) -> str:
        """The output as the parsers read it: special tokens kept when calls are parsed (as
        SGLang decodes a request with tools), the EOS that ended it dropped."""
        ids = self.ids[:-1] if self.ids and self.ids[-1] in self.eos_ids else self.ids
        return self.tokenizer.decode(ids, skip_special_tokens=not self.calls)

    def push(self, ids: Sequence[int]) -> list[Delta]:
        self.ids.extend(ids)
        text = self.text()
        if self.fmt.reasoning and THINK in text and not split_reasoning(text)[2]:
            self.num_reasoning_tokens += len(ids)
        return self._emit(self._stable(text), final=False)

    def finish(self) -> list[Delta]:
        return self._emit(self.text(), final=True)

    def _stable(self, text: str) -> str:
        """`text` less what the next tokens could still change."""
        for marker in self.fmt.markers:
            for n in range(min(len(marker) - 1, len(text)), 0, -1):
                if text.endswith(marker[:n]):
                    return text[:-n]
        return text

    def _emit(self, text: str, final: bool) -> list[Delta]:
        view = parse_text(text, self.fmt, reasoning=self.reasoning, calls=self.calls,
                          names=self.names)
        content = view.content
        if not final:
            content = content.rstrip()
            if self.fmt.calls == "llama3" and self.calls and text.startswith("{"):
                content = ""  # a call, or not: known once the text ends
        out = []
        for kind, new, old in (("reasoning", view.reasoning, self.parsed.reasoning),
                               ("content", content, self.parsed.content)):
            if len(new) > len(old) and new.startswith(old):
                out.append(Delta(kind, new[len(old):]))  # type: ignore[arg-type]
        calls = view.calls if final or self.fmt.calls == "qwen25" else []
        for call in calls[self._sent_calls:]:
            index = self._sent_calls
            out += [Delta("call", call.name, index, new_call_id()),
                    Delta("args", call.arguments, index)]
            self._sent_calls += 1
        for d in out:
            self.parsed.add(d)
        if final:
            for call in self.parsed.calls:
                call.complete = True
        return out
