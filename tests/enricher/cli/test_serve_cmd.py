"""`kvmiss serve` as a process: structured JSON logs, a clean stop on SIGTERM, config errors."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from zmq_ports import free_port

from kvmiss.enricher.otlp.spans import WIRE_SCAN


def test_json_logs_are_one_object_per_line_and_sigterm_stops_cleanly(tmp_path):
    config = tmp_path / "k.toml"
    config.write_text(f'[otlp]\ngrpc = "127.0.0.1:{free_port()}"\nhttp = "127.0.0.1:{free_port()}"\n'
                      f'[metrics]\nlisten = "127.0.0.1:{free_port()}"\n'
                      '[privacy]\ndigest_key = "serve-cmd-test-secret-01"\n[export]\ndiscard = true\n')
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


def _check(config_text: str, tmp_path, **env) -> subprocess.CompletedProcess:
    import os

    # --check binds every listen port for a moment: the defaults (4317, 4318, 9464) may be held
    # on a test machine, so a config that names none listens on any free port; and a config
    # needs a destination for its spans.
    for section, default in (("[otlp]", '[otlp]\ngrpc = "127.0.0.1:0"\nhttp = "127.0.0.1:0"\n'),
                             ("[metrics]", '[metrics]\nlisten = "127.0.0.1:0"\n'),
                             ("[export]", "[export]\ndiscard = true\n")):
        if section not in config_text:
            config_text = default + config_text
    config = tmp_path / "k.toml"
    config.write_text(config_text)
    return subprocess.run([sys.executable, "-m", "kvmiss.enricher.cli", "serve", "--config", str(config), "--check"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, **env})


def test_check_prints_what_would_run_and_never_the_key(tmp_path):
    port = free_port()  # (a port another process holds fails --check: tests/enricher/cli/test_misconfiguration.py)
    done = _check(f'[otlp]\ngrpc = "127.0.0.1:0"\nhttp = "127.0.0.1:{port}"\n[export]\nendpoint = "grpc://127.0.0.1:4319"\n'
                  '[privacy]\ndigest_key_env = "CHECK_TEST_KEY"\n'
                  '[[workers]]\nid = "w1"\nendpoint = "tcp://10.0.0.7:5557"\n'
                  'replay_endpoint = "tcp://10.0.0.7:5558"\ndp_rank = 2\n',
                  tmp_path, CHECK_TEST_KEY="check-test-secret-0123456789")
    assert done.returncode == 0, done.stderr
    assert "configuration OK" in done.stdout
    assert "w1: tcp://10.0.0.7:5559 (replay tcp://10.0.0.7:5560)" in done.stdout  # ports offset by rank
    assert "export: grpc://127.0.0.1:4319" in done.stdout and "key id " in done.stdout
    assert "check-test-secret" not in done.stdout + done.stderr
    assert ("OTLP wire path: compiled" if WIRE_SCAN else "OTLP wire path: parsed messages only") in done.stdout


def test_check_fails_on_what_start_up_would_fail_on(tmp_path):
    missing_key = _check('[privacy]\ndigest_key_env = "CHECK_TEST_UNSET_KEY"\n', tmp_path)
    assert missing_key.returncode == 2 and "CHECK_TEST_UNSET_KEY" in missing_key.stderr
    bad_export = _check('[export]\nendpoint = "ftp://127.0.0.1:4319"\n', tmp_path)
    assert bad_export.returncode == 2 and "export.endpoint" in bad_export.stderr
    bad_key = _check("[history]\nretention_s = -5\n", tmp_path)
    assert bad_key.returncode == 2 and "history.retention_s" in bad_key.stderr
    nowhere = _check(f'[export]\nrequest_records = "{tmp_path / "missing" / "r.jsonl"}"\n', tmp_path)
    assert nowhere.returncode == 2 and "export.request_records" in nowhere.stderr
    small = _check('[export]\nrequest_records = "r.jsonl"\nrequest_records_max_bytes = 1000\n', tmp_path)
    assert small.returncode == 2 and "request_records_max_bytes" in small.stderr
    fine = _check(f'[export]\ndiscard = true\nrequest_records = "{tmp_path / "r.jsonl"}"\n', tmp_path)
    assert fine.returncode == 0 and f"request records: {tmp_path / 'r.jsonl'} (renamed to .old at 256 MiB)" in fine.stdout
    assert not (tmp_path / "r.jsonl").exists()  # --check opens nothing


def _free_pair() -> int:
    """A free port whose successor is free too (process 1 of a group listens on port + 1)."""
    import socket

    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


def test_processes_run_a_group_on_consecutive_ports_each_serving_and_stopping_on_sigterm(tmp_path):
    import urllib.request

    base = {name: _free_pair() for name in ("grpc", "http", "metrics")}
    config = tmp_path / "k.toml"
    config.write_text(f'[otlp]\ngrpc = "127.0.0.1:{base["grpc"]}"\nhttp = "127.0.0.1:{base["http"]}"\n'
                      f'[metrics]\nlisten = "127.0.0.1:{base["metrics"]}"\n'
                      f'[export]\nfile = "{tmp_path / "out.jsonl"}"\n'
                      '[privacy]\ndigest_key = "serve-cmd-test-secret-01"\n')
    proc = subprocess.Popen([sys.executable, "-m", "kvmiss.enricher.cli", "serve", "--config", str(config),
                             "--processes", "2"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        up = set()
        while len(up) < 2 and time.monotonic() < deadline:
            for i in range(2):
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{base['metrics'] + i}/healthz", timeout=1) as r:
                        if r.status == 200:
                            up.add(i)
                except OSError:
                    pass
            time.sleep(0.2)
        assert up == {0, 1}, "both processes serve their own metrics port"
        for i in range(2):  # and their own OTLP/HTTP port
            request = urllib.request.Request(f"http://127.0.0.1:{base['http'] + i}/v1/traces", data=b"",
                                             headers={"Content-Type": "application/x-protobuf"}, method="POST")
            with urllib.request.urlopen(request, timeout=5) as r:
                assert r.status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == 0


def test_process_config_moves_every_port_and_file_but_port_0():
    from kvmiss.enricher.cli.serve_cmd import process_config
    from kvmiss.schemas.config import parse_config

    config = parse_config('[otlp]\ngrpc = "0.0.0.0:4317"\nhttp = "[::1]:0"\n[metrics]\nlisten = ":9464"\n'
                          '[export]\nfile = "out.jsonl"\njournal = "j"\nrequest_records = "req.jsonl"\n')
    moved = process_config(config, 3)
    assert (moved.otlp.grpc, moved.otlp.http, moved.metrics.listen) == ("0.0.0.0:4320", "[::1]:0", "127.0.0.1:9467")
    assert (moved.export.file, moved.export.journal, moved.export.request_records) == ("out.jsonl.3", "j.3", "req.jsonl.3")
    assert process_config(config, 0) is config
    off = parse_config('[otlp]\ngrpc = ""\nhttp = "127.0.0.1:4318"\n')
    assert process_config(off, 1).otlp.grpc == ""  # a receiver that is off stays off


def test_check_prints_the_fleet_each_source_resolves_and_refuses_what_serve_would(tmp_path):
    from pathlib import Path

    example = Path(__file__).resolve().parents[3] / "examples" / "fleet.toml"
    static = '[[workers]]\nid = "w0"\nendpoint = "tcp://10.0.0.7:5557"\n'
    done = _check(f'[fleet]\nfile = "{example}"\n' + static, tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"fleet file {example}: 2 workers" in done.stdout
    assert "decode-a: tcp://10.0.3.11:5557 (replay tcp://10.0.3.11:5558)" in done.stdout
    assert "decode-b: tcp://10.0.3.12:5557" in done.stdout and "w0: tcp://10.0.0.7:5557" in done.stdout

    not_yet = _check(f'[fleet]\nfile = "{tmp_path / "later.toml"}"\n', tmp_path)
    assert not_yet.returncode == 0 and "not there yet" in not_yet.stdout

    clash = tmp_path / "clash.toml"
    clash.write_text('[[workers]]\nid = "w0"\nendpoint = "tcp://10.0.0.8:5557"\n')
    refused = _check(f'[fleet]\nfile = "{clash}"\n' + static, tmp_path)
    assert refused.returncode == 2 and "id_clash" in refused.stderr and "'w0'" in refused.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text('[[workers]]\nid = "x"\nendpoint = "tcp://10.0.0.8:5557"\ndp_rank = "one"\n')
    refused = _check(f'[fleet]\nfile = "{bad}"\n', tmp_path)
    assert refused.returncode == 2 and "workers[0].dp_rank" in refused.stderr


def test_check_says_why_a_source_has_no_workers_yet(tmp_path):
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as mute:  # a nameserver that never answers
        mute.bind(("127.0.0.1", 0))
        port = mute.getsockname()[1]
        done = _check(f'[fleet.dns]\nname = "engines.test"\nnameserver = "127.0.0.1:{port}"\ntimeout_s = 0.3\n', tmp_path)
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("fleet dns engines.test"))
    assert line.endswith(": failed (no answer within 0.3 s): 0 workers for now (asked again once running)"), line
