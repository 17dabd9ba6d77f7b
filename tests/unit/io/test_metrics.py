"""io/metrics.py: every contract name is exported, with the right type and labels."""

from __future__ import annotations

import re
from pathlib import Path

from decode_worker.io.metrics import ABORT_REASONS, Metrics

CONTRACTS = Path(__file__).resolve().parents[3] / "docs" / "CONTRACTS.md"


def _contract_rows() -> list[tuple[str, str, str]]:
    rows = re.findall(r"^\| `(decode_worker_\w+)` \| (\w+) \| ([^|]*)\|", CONTRACTS.read_text(),
                      re.M)
    assert len(rows) >= 20
    return [(name, kind, labels.strip()) for name, kind, labels in rows]


def _types(text: str) -> dict[str, str]:
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))


def test_every_contract_metric_is_exported_with_its_type() -> None:
    text = Metrics().exposition()[0].decode()
    types = _types(text)
    for name, kind, _ in _contract_rows():
        assert types.get(name) == kind, (name, types.get(name))
    assert "_created" not in text


def test_labels_match_the_contract() -> None:
    m = Metrics()
    m.update_pool("full", available=1, used=2, evictable=3, protected=4, total=10)
    m.inc_http("generate", 200)
    m.inc_grpc("Generate", "OK")
    m.inc_transfer_failure("peer_dead")
    text = m.exposition()[0].decode()
    for name, _, labels in _contract_rows():
        for label in re.findall(r"`(\w+)`", labels):
            # a histogram's labelled series are its buckets (and _sum, _count)
            assert re.search(rf"^{name}(?:_bucket)?\{{[^}}]*\b{label}=", text, re.M), (
                name, label)


def test_methods_move_the_series() -> None:
    m = Metrics()
    m.update_pool("swa", available=5, used=6, evictable=1, protected=2, total=11)
    m.update_queues(prealloc=1, transfer=2, running=3)
    m.observe_prefix_match(100, 64)
    m.observe_transfer(num_bytes=4096, duration_s=0.01, num_descriptors=3, num_tokens=40)
    m.inc_abort("kv_timeout")
    m.inc_abort("no_such_reason")
    m.inc_request("finished")
    m.inc_generated_tokens(7)
    m.set_draining(True)
    m.observe_kv_event_lag("zmq", 0.0005)
    text = m.exposition()[0].decode()
    for line in [
        'decode_worker_kv_pages_available{pool="swa"} 5.0',
        'decode_worker_queue_requests{queue="running"} 3.0',
        "decode_worker_prefix_cache_hit_tokens_total 64.0",
        "decode_worker_transfer_bytes_total 4096.0",
        "decode_worker_transfer_received_tokens_total 40.0",
        "decode_worker_transfer_descriptors_count 1.0",
        'decode_worker_aborts_total{reason="kv_timeout"} 1.0',
        'decode_worker_aborts_total{reason="internal"} 1.0',
        'decode_worker_requests_total{status="aborted"} 2.0',
        'decode_worker_requests_total{status="finished"} 1.0',
        "decode_worker_generated_tokens_total 7.0",
        "decode_worker_draining 1.0",
        'decode_worker_kv_event_lag_seconds_count{transport="zmq"} 1.0',
        'decode_worker_kv_event_lag_seconds_bucket{le="0.001",transport="zmq"} 1.0',
    ]:
        assert line in text, line


def test_known_label_values_are_exported_at_zero_from_the_start() -> None:
    text = Metrics().exposition()[0].decode()
    for reason in ABORT_REASONS:
        assert f'decode_worker_aborts_total{{reason="{reason}"}} 0.0' in text
    assert 'decode_worker_kv_pages_capacity{pool="full"} 0.0' in text


def test_two_instances_do_not_share_a_registry() -> None:
    a, b = Metrics(), Metrics()
    a.inc_admission()
    assert "decode_worker_admissions_total 0.0" in b.exposition()[0].decode()
