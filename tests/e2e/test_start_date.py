"""Both P/D legs render the same prompt across midnight: `api.system_start_date`.

A gpt-oss chat template puts today's date in the harmony system message (`strftime_now`). The
prefill and the decode server render each request separately, so a date read at render time
gives a request that straddles midnight KV that does not match its tokens. The date is read
once, when the server's API config is built at start-up (or pinned by the setting); here the
clock is injected and moved past midnight between the two legs' renders, no sleeping.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from decode_worker.device.default_model import write_model
from decode_worker.device.harmony_template import HARMONY_CHAT_TEMPLATE
from decode_worker.io.api import ApiApp, ApiConfig
from decode_worker.settings import load_settings
from tests.fakes.fake_backend import ServerThread
from tests.fakes.fake_harmony import FakeHarmonyBackend

openai = pytest.importorskip("openai")
UTC = datetime.UTC
BOOT = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 9, "bootstrap_room": 7}


class FakeClock:
    """A clock tests move by hand; counts its reads."""

    def __init__(self, now: datetime.datetime) -> None:
        self.now, self.reads = now, 0

    def __call__(self) -> datetime.datetime:
        self.reads += 1
        return self.now


@pytest.fixture(scope="module")
def dated_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a gpt-oss-style template: the date in the system message."""
    model = write_model(tmp_path_factory.mktemp("dated") / "tiny-gpt-oss", seed=0)
    template = HARMONY_CHAT_TEMPLATE.replace(
        "<|start|>system<|message|>",
        "<|start|>system<|message|>Current date: {{ strftime_now('%Y-%m-%d') }}\n", 1)
    assert template != HARMONY_CHAT_TEMPLATE
    (model / "chat_template.jinja").write_text(template)
    return model


@contextlib.contextmanager
def legs(model: Path, configs: list[ApiConfig]) -> Iterator[list[tuple[Any, Any]]]:
    """(client, backend) of a prefill and a decode server with these configs."""
    with ExitStack() as stack:
        out = []
        for role, config in zip(("prefill", "decode"), configs, strict=True):
            backend = FakeHarmonyBackend(model_dir=model, role=role)
            server = stack.enter_context(ServerThread(ApiApp(backend, config)))
            out.append((openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0),
                        backend))
        yield out


def render_both(model: Path, configs: list[ApiConfig], clock: FakeClock) -> list[str]:
    """One Responses request and one chat request on both legs, the clock moving past
    midnight between the prefill's render and the decode's. The prompts, prefill's first."""
    with legs(model, configs) as servers:
        for client, _ in servers:
            client.responses.create(model=configs[0].served_model_name, input="hi",
                                    extra_body=BOOT)
            client.chat.completions.create(model=configs[0].served_model_name,
                                           messages=[{"role": "user", "content": "hi"}],
                                           extra_body=BOOT)
            clock.now += datetime.timedelta(seconds=3)
        return [p for _, backend in servers for p in backend.prompts]


def config(clock: FakeClock, **env: str) -> ApiConfig:
    settings = load_settings(environ={"DECODE_WORKER_MODEL__SERVED_MODEL_NAME": "gpt-oss",
                                      **env}).settings
    return ApiConfig.from_settings(settings, clock=clock)


def test_both_legs_keep_the_start_up_date_across_midnight(dated_model: Path) -> None:
    clock = FakeClock(datetime.datetime(2026, 3, 1, 23, 59, 58, tzinfo=UTC))
    configs = [config(clock), config(clock)]  # both servers started on March 1st
    reads = clock.reads
    prompts = render_both(dated_model, configs, clock)
    assert clock.now.date() == datetime.date(2026, 3, 2)  # the decode leg rendered after 0:00
    assert clock.reads == reads  # rendering never reads the clock
    assert len(prompts) == 4 and prompts[:2] == prompts[2:]
    assert all("Current date: 2026-03-01\n" in p for p in prompts)


def test_the_setting_pins_servers_started_on_different_days(dated_model: Path) -> None:
    clock = FakeClock(datetime.datetime(2026, 3, 1, 23, 59, 58, tzinfo=UTC))
    pin = {"DECODE_WORKER_API__SYSTEM_START_DATE": "2026-02-14"}
    first, started = config(clock, **pin), clock.now
    clock.now += datetime.timedelta(hours=1)  # the other server (re)started after midnight
    prompts = render_both(dated_model, [first, config(clock, **pin)], clock)
    assert prompts[:2] == prompts[2:]
    assert all("Current date: 2026-02-14\n" in p for p in prompts)
    # unpinned, such a pair renders two dates: what the setting is for (docs/DEPLOY.md)
    unpinned = [config(FakeClock(started)), config(clock)]
    assert unpinned[0].system_start_date != unpinned[1].system_start_date


def test_the_utc_date_is_taken_whatever_the_clock_zone() -> None:
    east = datetime.timezone(datetime.timedelta(hours=9))
    clock = FakeClock(datetime.datetime(2026, 3, 2, 8, 0, tzinfo=east))  # 23:00 UTC on the 1st
    assert config(clock).system_start_date == datetime.date(2026, 3, 1)
