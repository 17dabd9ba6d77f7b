"""`FakeHarmonyBackend`: a backend whose model output is a given harmony token sequence.

A random-weight model cannot be made to emit harmony (an analysis message, a final answer, a
tool call), so the API tests of the harmony parser script the output instead: the last user
message names a script (`script:NAME`), the backend replies with that script's ids, tokenized
by the real tokenizer of the tiny model (its chat template renders the prompt, tools included).
The prefill role answers the first token only, as the prefill peer does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from decode_worker.device.tokenizer import Tokenizer
from decode_worker.io.api.backend import GenerateInput
from tests.fakes.fake_backend import FakeBackend, ServerThread

ANALYSIS = "<|channel|>analysis<|message|>The user asks about the weather; call the tool.<|end|>"
CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris", "unit": "celsius"}<|call|>')
SECOND_CALL = ('<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>'
               '{"tz": "Europe/Paris"}<|call|>')
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris, 22 °C.<|return|>"
SCRIPTS = {
    "call": ANALYSIS + CALL,
    "final": ANALYSIS + FINAL,
    "two": ANALYSIS + CALL + SECOND_CALL,
    "answer": "<|channel|>final<|message|>Sunny, 22 °C.<|return|>",
}


@dataclass
class FakeHarmonyBackend(FakeBackend):
    """Replies with `SCRIPTS[name]` for the prompt that holds `script:name` (default "final").
    `role` "prefill": the first token only, finish "length"."""

    model_dir: Path = Path("/nonexistent")
    role: str = "decode"
    harmony_tokenizer: Tokenizer | None = None
    prompts: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.harmony_tokenizer = Tokenizer.from_dir(self.model_dir)
        self.tokenizer = self.harmony_tokenizer  # type: ignore[assignment]
        self.model_path = str(self.model_dir)

    def _script(self, inp: GenerateInput) -> tuple[list[int], str, int | None]:
        tok = self.harmony_tokenizer
        assert tok is not None
        prompt = tok.decode(inp.input_ids, skip_special_tokens=False)
        self.prompts.append(prompt)
        name = next((n for n in SCRIPTS if f"script:{n}" in prompt.rsplit("<|start|>user", 1)[-1]),
                    "final")
        ids = tok.encode(SCRIPTS[name])
        if self.role == "prefill":
            return ids[:1], "length", None
        limit = inp.sampling.max_new_tokens
        if len(ids) > limit:
            return ids[:limit], "length", None
        return ids, "stop", ids[-1]


@contextmanager
def harmony_pd_behind_smg(
    model_dir: Path,
) -> Iterator[tuple[Any, FakeHarmonyBackend, FakeHarmonyBackend]]:
    """A prefill and a decode `FakeHarmonyBackend`, each behind its own ApiApp ("gpt-oss"),
    paired by smg in P/D mode: yields (an OpenAI client of the router, prefill, decode)."""
    import openai

    from decode_worker.daemon.shared.procs import free_port
    from decode_worker.io.api import ApiApp, ApiConfig
    from tests.e2e.driver import RouterProcess

    pre = FakeHarmonyBackend(model_dir=model_dir, role="prefill", chunk_tokens=1 << 20)
    dec = FakeHarmonyBackend(model_dir=model_dir, chunk_tokens=2, delay_s=0.002)
    config = ApiConfig(served_model_name="gpt-oss")
    with ServerThread(ApiApp(pre, config)) as p, ServerThread(ApiApp(dec, config)) as d:
        router = RouterProcess(p.url, free_port(), d.url, free_port())
        with router:
            router.wait_workers(60)
            yield (openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0,
                                 timeout=30), pre, dec)
        router.stop()
