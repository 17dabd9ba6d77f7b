"""The shells both prefill peers share: ours (`peer.py`, `push.py`) and the one speaking SGLang's
protocol (`sglang_peer.py`, `sglang_push.py`). Their wire formats and room book-keeping differ;
these do not:

- `PeerShell`: the NIXL agent, the lock, the job queue and the compute thread that runs
  `run_compute_loop`; `bootstrap_port`; `add_prompt`, where the HTTP half comes in; `close`.
- `PushShell`: a pipeline's page free lists, aux rows and pushes in flight; taking pages
  (waiting for in-flight pushes to return theirs), holding them and an aux row while a job is
  prefilled and posted, its first token, and giving them back.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar, Generic, Protocol, TypeVar

import torch

from decode_worker.core.sampling import MAX_TOP_LOGPROBS, SamplingParams, TopLogprobs
from decode_worker.daemon.prefill.compute_loop import Pipeline, run_compute_loop
from decode_worker.daemon.prefill.state import OnDone, PageFreeList
from decode_worker.device.grammar import GrammarState
from decode_worker.device.runner import ModelRunner
from decode_worker.device.sampler import Sampler, SampleRow
from decode_worker.errors import OutOfPages
from decode_worker.io.kv.nixl_agent import NixlAgent, unique_agent_name
from decode_worker.settings import TransferSettings

JobT = TypeVar("JobT")
PushT = TypeVar("PushT")


class BootstrapEndpoint(Protocol):
    """Where decode sides find a peer (a ZMQ ROUTER, or SGLang's HTTP bootstrap server)."""

    port: int

    def close(self) -> None: ...


class PeerShell(ABC, Generic[JobT]):
    """The shell of a prefill peer (module doc). The subclass sets `server` and `_push`, and
    calls `_serve()` last in its `__init__`; jobs it puts on `_jobs` reach its `_start` on the
    compute thread. Raises ConfigError if NIXL cannot start."""

    JOIN_TIMEOUT_S: ClassVar[float] = 10.0  # how long `close` waits for the compute thread
    server: BootstrapEndpoint
    _push: Pipeline

    def __init__(self, runner: ModelRunner, settings: TransferSettings) -> None:
        self.runner, self.settings = runner, settings
        self.agent = NixlAgent(unique_agent_name("prefill"), settings.backend,
                               settings.progress_delay_us)  # fmt: skip
        self._lock = threading.Lock()  # guards the room book-keeping both threads share
        self._jobs: queue.Queue[JobT | None] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._compute_loop, name="prefill", daemon=True)

    def _serve(self) -> None:
        """Start the compute thread (the last step of the subclass's `__init__`)."""
        self._thread.start()

    @property
    def bootstrap_port(self) -> int:
        """The bound bootstrap port (`transfer.bootstrap_port`, or the free one for 0)."""
        return int(self.server.port)

    def add_prompt(
        self, room: int, token_ids: list[int], on_done: OnDone | None = None,
        sampling: SamplingParams | None = None,
    ) -> None:  # fmt: skip
        """The prompt of `room` (from HTTP); `sampling` picks the first token (None: greedy).
        `on_done` runs once the KV is handed off or the room failed (or expired): on the
        compute thread, or on this one for a room that fails at once; it must not block."""
        self._add_prompt(room, token_ids, on_done, sampling)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.JOIN_TIMEOUT_S)
        self.server.close()
        self._close_links()
        self.agent.close()

    @abstractmethod
    def _add_prompt(self, room: int, token_ids: list[int], on_done: OnDone | None,
                    sampling: SamplingParams | None) -> None:
        """Match the HTTP half of `room` (`add_prompt`)."""

    @abstractmethod
    def _start(self, job: JobT) -> None:
        """Prefill a matched job and post its WRITEs (compute thread)."""

    @abstractmethod
    def _sweep(self, now: float) -> None:
        """Expire what waited too long (compute thread)."""

    def _close_links(self) -> None:
        """Close what the subclass serves besides `server` (before the agent goes)."""

    def _compute_loop(self) -> None:
        run_compute_loop(self._stop, self._jobs, self._push, self._start, self._sweep)


@dataclass(frozen=True, slots=True)
class Held:
    """What a job holds while it is prefilled and its WRITEs fly: one page of each of our pools
    per prompt page, and the aux row its first token is written from."""

    full_ids: list[int]
    swa_ids: list[int]
    aux_row: int


class PushShell(ABC, Generic[PushT]):
    """The shell of a push pipeline (module doc): `PushT` is its record of a push in flight.
    Compute thread only."""

    def __init__(self, runner: ModelRunner, num_aux_rows: int) -> None:
        self.runner = runner
        self.sampler = Sampler(runner.device)
        self._free = PageFreeList(runner.pools.num_pages["full"], runner.pools.num_pages["swa"],
                                  runner.has_swa)  # no sliding layers: no SWA pages held
        self._aux_rows = list(range(num_aux_rows))
        self._pushes: list[PushT] = []

    def is_busy(self) -> bool:
        """True while some job's WRITEs are in flight."""
        return bool(self._pushes)

    @abstractmethod
    def reap(self, now: float) -> None:
        """Finish every push whose WRITEs settled or are past their deadline; give back what
        it held (`_give_back`)."""

    @contextmanager
    def _holding(self, num_pages: int) -> Iterator[Held]:
        """`num_pages` pages of each pool and an aux row for the body; all given back if the
        body raises (then nothing is held). Raises OutOfPages when even an idle pipeline has
        too few."""
        full_ids, swa_ids = self._take_pages(num_pages)
        held = Held(full_ids, swa_ids, self._aux_rows.pop())
        try:
            yield held
        except BaseException:
            self._give_back(held)
            raise

    def _give_back(self, held: Held) -> None:
        self._free.give(held.full_ids, held.swa_ids)
        self._aux_rows.append(held.aux_row)

    def _take_pages(self, n_pages: int) -> tuple[list[int], list[int]]:
        """Pages for a prompt, waiting for in-flight pushes to return theirs if needed.
        Raises OutOfPages when even an idle peer has too few."""
        while True:
            try:
                return self._free.take(n_pages)
            except OutOfPages:
                if not self._pushes:
                    raise
                self.reap(time.monotonic())
                time.sleep(0.0005)

    def _first_token(self, prompt: list[int], held: Held, sampling: SamplingParams | None
                     ) -> tuple[int, float, TopLogprobs]:
        """Prefill `prompt` into the held pages; its first output token (`first_token`)."""
        logits = self.runner.prefill(prompt, held.full_ids, held.swa_ids)  # logits: [V] f32
        return first_token(self.sampler, logits, sampling)

    def _sync(self) -> None:
        """Wait until the prefill's KV is in the pools (before NIXL reads them)."""
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)


def first_token(sampler: Sampler, logits: torch.Tensor, sampling: SamplingParams | None
                ) -> tuple[int, float, TopLogprobs]:
    """The first output token of a prefill (logits: [V] f32; greedy without `sampling`), its
    logprob under the raw distribution and the MAX_TOP_LOGPROBS most likely tokens (the decode
    side keeps what its request asked); a grammar constrains it (structured output)."""
    sampling = sampling or SamplingParams(temperature=0.0)
    row = SampleRow(sampling, step=0, return_logprob=True, top_logprobs=MAX_TOP_LOGPROBS,
                    grammar=GrammarState.for_sampling(sampling))
    out = sampler.sample(logits[None], [row])  # logits[None]: [1, V]
    return out.token_ids[0], float(out.logprobs[0] or 0.0), out.top_logprobs[0] or []
