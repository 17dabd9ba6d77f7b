"""ServerProcess's port bookkeeping (no process started): a port-0 child's ports are unknown until
it reports them, and a restart (`again`) reuses every port it bound, gRPC included."""

from __future__ import annotations

import os

from decode_worker.daemon.shared.procs import ServerProcess


def _discard(proc: ServerProcess) -> None:
    proc.log.close()
    os.unlink(proc.log.name)


def test_a_port_zero_grpc_port_is_known_once_reported_and_kept_by_a_restart() -> None:
    proc = ServerProcess("p", ["serve", "--port", "0", "--grpc-port", "0", "--set", "x=0"])
    try:
        assert proc.grpc_port is None and proc.grpc_target is None  # not reported yet
        with open(proc.ports_file, "w", encoding="utf-8") as f:
            f.write('{"http": 41001, "grpc": 41002, "kv_events": 41003}')
        assert proc._read_ports()
        assert (proc.port, proc.grpc_target) == (41001, "127.0.0.1:41002")
        again = proc.again()
        try:
            assert again.args == ["serve", "--port", "41001", "--grpc-port", "41002",
                                  "--set", "x=0"]
            assert (again.port, again.grpc_target) == (41001, "127.0.0.1:41002")
        finally:
            _discard(again)
    finally:
        os.unlink(proc.ports_file)
        _discard(proc)


def test_a_fixed_grpc_port_is_known_before_the_start() -> None:
    proc = ServerProcess("p", ["prefill", "--grpc-port", "41010"], grpc_port=41010)
    try:
        assert proc.grpc_target == "127.0.0.1:41010"
    finally:
        _discard(proc)
