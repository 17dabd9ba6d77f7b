"""Speculative decoding in a running decode worker (`serve --speculative-algorithm NGRAM`),
against one without: the same greedy tokens for the same requests (one at a time and
concurrent, streamed and not, across requests whose continuation the shared memory holds),
SGLang's spec fields in meta_info, the Prometheus counters and histograms, and the settings in
/server_info."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.live_fixtures import Live, gen_body, live_server

pytestmark = pytest.mark.slow
K = 6


@pytest.fixture(scope="module")
def spec_live(e2e_model_dir: Path) -> Iterator[Live]:
    with live_server(e2e_model_dir, "--speculative-algorithm", "ngram",
                     "--speculative-num-draft-tokens", str(K), name="spec") as live:
        yield live


def _prompts() -> list[list[int]]:
    loop = [17, 42, 99, 5, 23, 61, 8, 77]  # a phrase said again: prompt lookup finds it
    return [loop * 6 + [3 + i] for i in range(3)] + [[(i * 37) % 200 + 3 for i in range(50)]]


def _generate(live: Live, ids: list[int], max_new: int, stream: bool = False) -> dict[str, Any]:
    body = gen_body(ids, max_new, stream=stream)
    if stream:
        events = live.sse("/generate", body)
        return dict(events[-2])
    resp = live.post("/generate", body)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def test_speculation_keeps_the_greedy_tokens_and_reports_what_it_did(
        spec_live: Live, plain_live: Live) -> None:
    info = spec_live.get("/server_info").json()
    assert info["speculative_algorithm"] == "NGRAM" and info["speculative_num_draft_tokens"] == K
    before = spec_live.metrics()
    prompts = _prompts()
    for i, ids in enumerate(prompts):  # one at a time; the later ones find the earlier ones
        want = _generate(plain_live, ids, 40)
        got = _generate(spec_live, ids, 40, stream=bool(i % 2))
        assert got["output_ids"] == want["output_ids"], i
    with ThreadPoolExecutor(4) as pool:  # a batch of verifies
        wants = list(pool.map(lambda p: _generate(plain_live, p, 30), prompts))
        gots = list(pool.map(lambda p: _generate(spec_live, p, 30), prompts))
    assert [g["output_ids"] for g in gots] == [w["output_ids"] for w in wants]
    metas = [g["meta_info"] for g in gots]
    drafted = [m for m in metas if "spec_verify_ct" in m]
    assert drafted, metas  # the repeated phrase is drafted
    for m in drafted:
        assert m["spec_num_correct_drafts"] <= m["spec_num_proposed_drafts"]
        assert m["spec_accept_length"] == pytest.approx(m["completion_tokens"]
                                                        / m["spec_verify_ct"])
        assert m["spec_accept_rate"] == pytest.approx(m["spec_num_correct_drafts"]
                                                      / m["spec_num_proposed_drafts"])
    after = spec_live.wait_idle()
    delta = {n: after.value(f"decode_worker_spec_{n}_total") - before.value(
        f"decode_worker_spec_{n}_total") for n in ("proposed_tokens", "accepted_tokens",
                                                    "verify_steps")}
    assert delta["verify_steps"] > 0 and 0 < delta["accepted_tokens"] <= delta["proposed_tokens"]
    assert after.value("decode_worker_spec_accept_length_count") > 0
    assert not plain_live.get("/server_info").json()["speculative_algorithm"]


def test_a_grammar_request_never_drafts_and_keeps_its_tokens(spec_live: Live,
                                                              plain_live: Live) -> None:
    """Structured output with speculation on: a batch with a grammar row samples on the host
    and drafts nothing, so the request is exactly what it is without speculation (and has no
    spec fields), even where its prompt repeats one the shared memory holds."""
    ids = _prompts()[0]
    _generate(spec_live, ids, 20)  # the memory now holds this prompt's continuation
    body = gen_body(ids, 12)
    body["sampling_params"] = {**body["sampling_params"], "regex": "[ab]+"}
    got = spec_live.post("/generate", body)
    want = plain_live.post("/generate", body)
    assert got.status_code == want.status_code == 200, (got.text, want.text)
    assert got.json()["output_ids"] == want.json()["output_ids"]
    assert "spec_verify_ct" not in got.json()["meta_info"]
