"""Interop tests against other stacks' own code; sglang_prefill/ runs in its own venv only."""
