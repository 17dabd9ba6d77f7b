"""Chat output written as text markers (Qwen3 `<think>` / `<tool_call>`, Llama 3.x JSON calls)."""
