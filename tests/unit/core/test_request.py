"""The request state machine: allowed transitions, and what each terminal path releases."""

from __future__ import annotations

import pytest

from decode_worker.core.request import DecodeRequest, RequestState, StepCommit
from decode_worker.errors import InvalidTransition
from tests.unit.core.test_admission_helpers import PS, admit_one, make_rig, req, run_to_finish

S = RequestState


def test_queued_cannot_jump_to_running() -> None:
    r = DecodeRequest("a", 1, [1, 2, 3], 4)
    with pytest.raises(InvalidTransition):
        r.transition(S.RUNNING, 0.0)
    assert r.state is S.QUEUED


def test_reserved_needs_kv_and_leaving_kv_needs_its_keeper() -> None:
    rig = make_rig()
    r = DecodeRequest("a", 1, [1, 2, 3], 4)
    with pytest.raises(InvalidTransition):
        r.transition(S.RESERVED, 0.0)
    r2 = req("b", 100)
    admit_one(rig, r2)
    with pytest.raises(InvalidTransition):
        r2.transition(S.ABORTED, 1.0, reason="client_abort")
    assert r2.state is S.RESERVED and r2.kv is not None


def test_ready_needs_the_first_token_and_running_its_keeper_which_caches_the_prompt() -> None:
    rig = make_rig()
    r = req("a", 100)
    admit_one(rig, r)
    with pytest.raises(InvalidTransition):
        r.transition(S.READY, 1.0)  # no output yet: the prefill's first token is needed
    r.transition(S.READY, 1.0, first_token=9)
    assert r.output_ids == [9]
    with pytest.raises(InvalidTransition):
        r.transition(S.RUNNING, 2.0)
    assert r.state is S.READY
    assert r.kv is not None and r.kv.cache_protected_len == 0
    r.transition(S.RUNNING, 2.0, keeper=rig.ctx)
    assert r.kv.cache_protected_len == 100 // PS * PS  # the prompt's whole pages: the tree's


def test_a_resumed_request_keeps_its_own_last_token() -> None:
    rig = make_rig()
    r = req("a", 100)
    r.output_ids = [4, 5]  # retracted after two tokens, readmitted
    admit_one(rig, r)
    r.transition(S.READY, 1.0, first_token=9)
    assert r.output_ids == [4, 5]


def test_terminal_states_accept_nothing() -> None:
    r = DecodeRequest("a", 1, [1], 4)
    r.transition(S.ABORTED, 0.0, reason="client_abort")
    for to in S:
        with pytest.raises(InvalidTransition):
            r.transition(to, 1.0)
    assert r.reason == "client_abort" and r.entered_at[S.ABORTED] == 0.0


def test_abort_before_arrival_frees_without_caching() -> None:
    rig = make_rig()
    r = req("a", 300)
    admit_one(rig, r)
    r.transition(S.RECEIVING, 0.5)
    r.transition(S.ABORTED, 1.0, keeper=rig.ctx, reason="peer_dead")
    assert rig.tree is not None
    assert rig.tree.full_stats().evictable == 0  # nothing cached from a half-written transfer
    assert rig.full.num_free == rig.full.num_total
    rig.check([])


def test_failed_transfer_frees_everything() -> None:
    rig = make_rig(radix=False)
    r = req("a", 300)
    admit_one(rig, r)
    r.transition(S.FAILED, 1.0, keeper=rig.ctx, reason="transfer_failed")
    assert r.kv is None and r.reason == "transfer_failed"
    rig.check([])


def test_finish_caches_the_aligned_prefix_and_returns_the_rest() -> None:
    rig = make_rig()
    r = req("a", 895)
    admit_one(rig, r)
    run_to_finish(rig, r, steps=3)
    assert r.state is S.FINISHED and r.kv is None
    assert rig.tree is not None
    st = rig.tree.full_stats()
    assert st.held_by_requests == 0 and st.protected == 0 and st.evictable == 897 // 64
    rig.check([])


def test_a_committed_step_tracks_fill_ids() -> None:
    rig = make_rig()
    r = req("a", 10)
    admit_one(rig, r)
    r.transition(RequestState.READY, 1.0, first_token=77)
    assert r.output_ids == [77] and r.fill_ids == r.prompt_ids
    r.transition(RequestState.RUNNING, 1.0, keeper=rig.dec.ctx)
    rig.dec.prepare_step([r], 1.0)
    StepCommit([r]).commit([78])
    assert r.kv is not None and r.kv.token_ids == [*r.prompt_ids, 77]
    assert r.fill_ids == r.kv.token_ids and r.fill_len == 11


def _running(rig: object, rid: str, n: int, first: int) -> DecodeRequest:
    r = req(rid, n)
    admit_one(rig, r)  # type: ignore[arg-type]
    r.transition(RequestState.READY, 1.0, first_token=first)
    r.transition(RequestState.RUNNING, 1.0, keeper=rig.ctx)  # type: ignore[attr-defined]
    return r


def test_a_step_commits_runs_of_one_or_more_tokens_and_kv_for_all_but_the_last() -> None:
    """A verified step: request i ran its input token and its run's drafts; its output grows by
    the run, its KV by the input token and every token of the run but the last (the next
    input). The prompt list a fresh ReqKV shares is copied, never appended to."""
    rig = make_rig()
    a, b = _running(rig, "a", 10, 77), _running(rig, "b", 12, 50)
    prompt_a = list(a.prompt_ids)
    batch = StepCommit([a, b])
    batch.commit_runs([[78, 79, 80], [51]])
    assert a.output_ids == [77, 78, 79, 80] and b.output_ids == [50, 51]
    assert a.kv is not None and a.kv.token_ids == [*prompt_a, 77, 78, 79]
    assert a.prompt_ids == prompt_a and a.fill_ids == a.kv.token_ids
    assert b.kv is not None and b.kv.token_ids == [*b.prompt_ids, 50]
    batch.commit([81, 52])  # the n = 1 step is the same rule
    assert a.fill_ids == a.kv.token_ids and a.output_ids[-1] == 81 and b.output_ids[-1] == 52
    only_b = batch.subset([False, True])
    only_b.commit([53])
    assert b.output_ids[-2:] == [52, 53] and a.output_ids[-1] == 81
    assert only_b.last_tokens() == [53]
    with pytest.raises(InvalidTransition):
        batch.commit_runs([[], [1]])


def test_a_step_commit_takes_running_requests_only() -> None:
    rig = make_rig()
    r = req("a", 10)
    admit_one(rig, r)
    with pytest.raises(InvalidTransition):  # RESERVED
        StepCommit([r])
    r.transition(RequestState.READY, 1.0, first_token=5)
    with pytest.raises(InvalidTransition):  # READY, not yet in the batch
        StepCommit([r])
    assert r.output_ids == [5]
