"""tests/stack needs the real Collector, Jaeger v2 and Prometheus. Where one is missing the
directory is not collected and the run ends with one line saying what to install or run,
unless KVMISS_REQUIRE_STACK=1 (.ci/run sets it): then every test here fails, naming the part."""

from __future__ import annotations

import os

import pytest
from stack import HOW_TO_GET, missing_parts

REQUIRED = os.environ.get("KVMISS_REQUIRE_STACK") == "1"
MISSING = missing_parts()
MESSAGE = f"{', '.join(MISSING)} missing -- {HOW_TO_GET}"

if MISSING and not REQUIRED:
    collect_ignore_glob = ["test_*.py"]


def pytest_terminal_summary(terminalreporter):
    if MISSING and not REQUIRED:
        terminalreporter.write_line(f"SKIPPED tests/stack: {MESSAGE}", yellow=True)


@pytest.fixture(scope="session", autouse=True)
def _stack_present():
    """Session scope: runs before the module fixtures that start the stack."""
    if MISSING:
        pytest.fail(f"KVMISS_REQUIRE_STACK=1: {MESSAGE}")
