"""gpt-oss's harmony output format on token ids: the parser (reasoning, content, tool calls),
the special tokens, and the grammar that forces a tool call (`tool_choice`)."""

from decode_worker.io.api.harmony.parser import Delta, HarmonyParser, Parsed, ToolCall, parse
from decode_worker.io.api.harmony.tokens import HarmonyTokens

__all__ = ["Delta", "HarmonyParser", "HarmonyTokens", "Parsed", "ToolCall", "parse"]
