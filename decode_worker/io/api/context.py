"""What the endpoint modules (`generate`, `openai`, `admin`) use of the app: `ApiContext`.

The endpoints take this Protocol instead of `ApiApp`, so the import graph of `io/api` has no
cycle: `app.py` imports the endpoints, no module of the package imports `app.py`.
"""

from __future__ import annotations

from typing import Protocol

from decode_worker.core.sampling import SamplingParams
from decode_worker.io.api.backend import GenerateBackend, GenerateInput
from decode_worker.io.api.common import ApiConfig
from decode_worker.io.api.run import GenerationRun
from decode_worker.io.api.targets import Target
from decode_worker.io.metrics import Metrics


class ApiContext(Protocol):
    """The app as the endpoints see it; `ApiApp` is the implementation. Event loop only."""

    backend: GenerateBackend
    config: ApiConfig
    metrics: Metrics | None

    def make_input(
        self, rid: str | None, ids: list[int], sampling: SamplingParams, target: Target,
        *, stream: bool, return_logprob: bool, endpoint: str, received_at: float = 0.0,
        top_logprobs: int = 0,
    ) -> GenerateInput:
        """A GenerateInput whose `rid` is unique among the runs in flight."""
        ...

    async def start_run(self, inp: GenerateInput) -> GenerationRun:
        """Submit `inp` and wait for its first chunk; raises what the run failed with."""
        ...

    def model_name(self) -> str:
        """The served model name: what the OpenAI routes answer with."""
        ...

    def check_model(self, requested: str | None) -> None:
        """Raise ModelNotFound (404) when a request names a model this server does not serve."""
        ...

    def max_new_tokens(self, prompt_tokens: int, requested: int | None,
                       default: int | None) -> int:
        """The max_new_tokens to run with; ClientError (400) past the model's context length."""
        ...
