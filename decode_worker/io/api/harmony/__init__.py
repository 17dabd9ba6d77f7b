"""gpt-oss's harmony output format on token ids: the parser (reasoning, content, tool calls),
the special tokens, how chat answers are shaped from it, and the grammar that forces a call.

Own code rather than the `openai-harmony` library (what vLLM uses): that library loads its
vocabulary file (o200k) from the network at first use, which an air-gapped cluster does not
have, and it needs the vocabulary only to know the special tokens, which the checkpoint's own
tokenizer already names. Parsing ids (not text) also makes `skip_special_tokens` irrelevant to
the parse and lets the built-in tiny model (byte tokenizer) run every path here.
"""

from decode_worker.io.api.harmony.parser import Delta, HarmonyParser, Parsed, ToolCall, parse
from decode_worker.io.api.harmony.tokens import HarmonyTokens

__all__ = ["Delta", "HarmonyParser", "HarmonyTokens", "Parsed", "ToolCall", "parse"]
