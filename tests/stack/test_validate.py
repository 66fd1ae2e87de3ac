"""Every Collector configuration kvmiss ships passes the Collector's own ``validate``, run by
the Collector distribution of tests/peers/otelcol on the file as it is (no variable set: every
``${env:NAME:-default}`` at its default), and again with the endpoints moved by the
environment as the end-to-end tests move them. A broken copy fails it (the check can fail)."""

from __future__ import annotations

import pytest
from stack import COLLECTOR_EXAMPLES, validate

SHIPPED = sorted(COLLECTOR_EXAMPLES.glob("*.yaml")) + sorted(COLLECTOR_EXAMPLES.glob("*.yml"))
ENDPOINTS_MOVED = {
    "OTELCOL_INGEST_GRPC": "127.0.0.1:24317", "OTELCOL_INGEST_HTTP": "127.0.0.1:24318",
    "OTELCOL_ENRICHED_GRPC": "127.0.0.1:24417", "OTELCOL_SAMPLER_GRPC": "127.0.0.1:24517",
    "KVMISS_OTLP_GRPC": "127.0.0.1:25317", "KVMISS_REPLICAS": "[127.0.0.1:25001, 127.0.0.1:25002]",
    "OTELCOL_GATEWAYS": "[127.0.0.1:24517]", "TRACE_BACKEND_OTLP_GRPC": "127.0.0.1:26317",
    "SPANMETRICS_PROMETHEUS": "127.0.0.1:28889", "OTELCOL_TELEMETRY_PORT": "28888",
}


def test_the_examples_directory_has_collector_files():
    assert {p.name for p in SHIPPED} >= {"single.yaml", "replicas.yaml"}


@pytest.mark.parametrize("config", SHIPPED, ids=lambda p: p.name)
@pytest.mark.parametrize("env", [{}, ENDPOINTS_MOVED], ids=["defaults", "endpoints-from-env"])
def test_shipped_collector_config_passes_the_collectors_validate(config, env):
    result = validate(config, env)
    assert result.returncode == 0, f"{config.name}: otelcol validate failed:\n{result.stderr[-3000:]}"


def test_validate_rejects_a_broken_copy(tmp_path):
    broken = tmp_path / "replicas.yaml"
    text = (COLLECTOR_EXAMPLES / "replicas.yaml").read_text()
    assert "decision_wait: 30s" in text
    broken.write_text(text.replace("decision_wait: 30s", "decision_wait: 30s\n    decision_waits: 30s"))
    result = validate(broken)
    assert result.returncode != 0 and "decision_waits" in result.stderr, result.stderr[-2000:]
