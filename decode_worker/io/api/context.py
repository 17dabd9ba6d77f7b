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
from decode_worker.io.api.schemas import Bootstrap
from decode_worker.io.metrics import Metrics


class ApiContext(Protocol):
    """The app as the endpoints see it; `ApiApp` is the implementation. Event loop only."""

    backend: GenerateBackend
    config: ApiConfig
    metrics: Metrics | None

    def make_input(
        self, rid: str | None, ids: list[int], sampling: SamplingParams, boot: Bootstrap,
        *, stream: bool, return_logprob: bool, endpoint: str, received_at: float = 0.0,
        top_logprobs: int = 0,
    ) -> GenerateInput:
        """A GenerateInput whose `rid` is unique among the runs in flight."""
        ...

    async def start_run(self, inp: GenerateInput) -> GenerationRun:
        """Submit `inp` and wait for its first chunk; raises what the run failed with."""
        ...

    def model_name(self, requested: str | None = None) -> str:
        """The model name the OpenAI routes answer with."""
        ...
