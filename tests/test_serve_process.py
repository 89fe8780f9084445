"""`prefixcache serve` as a process: how it ends."""

from __future__ import annotations

import signal

from router_fixtures import ReplicaProcess, write_tiny_hf_model


def test_ctrl_c_shuts_a_real_server_down_with_exit_code_0_and_no_traceback(tmp_path) -> None:
    server = ReplicaProcess(write_tiny_hf_model(tmp_path / "tiny"), tmp_path)
    try:
        server.start().wait_ready()
        assert server.process is not None
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(30) == 0
    finally:
        server.stop()
    log = server.log_path.read_text()
    assert "shutting down" in log and "Traceback" not in log, log[-2000:]
