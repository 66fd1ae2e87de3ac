"""`kvmiss serve` as a process: structured JSON logs, a clean stop on SIGTERM, config errors."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from zmq_ports import free_port


def test_json_logs_are_one_object_per_line_and_sigterm_stops_cleanly(tmp_path):
    config = tmp_path / "k.toml"
    config.write_text(f'[otlp]\ngrpc = "127.0.0.1:{free_port()}"\nhttp = "127.0.0.1:{free_port()}"\n'
                      f'[metrics]\nlisten = "127.0.0.1:{free_port()}"\n'
                      '[privacy]\ndigest_key = "serve-cmd-test-secret-01"\n')
    proc = subprocess.Popen([sys.executable, "-m", "kvmiss.enricher.cli", "serve", "--config", str(config),
                             "--log-format", "json"], stderr=subprocess.PIPE, text=True)
    lines = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(json.loads(line))  # every line is JSON
        if "OTLP grpc" in lines[-1]["msg"]:
            break
    proc.send_signal(signal.SIGTERM)
    _, rest = proc.communicate(timeout=30)
    assert proc.returncode == 0
    lines += [json.loads(line) for line in rest.splitlines() if line.strip()]
    assert any("OTLP grpc" in r["msg"] for r in lines)
    assert all({"ts", "level", "logger", "msg"} <= set(r) for r in lines)
    assert not any("serve-cmd-test-secret" in json.dumps(r) for r in lines)


def test_a_bad_config_exits_2_naming_the_key(tmp_path):
    config = tmp_path / "k.toml"
    config.write_text("[otlp]\nmax_body_bytes = -1\n")
    proc = subprocess.run([sys.executable, "-m", "kvmiss.enricher.cli", "serve", "--config", str(config)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "otlp.max_body_bytes" in proc.stderr
