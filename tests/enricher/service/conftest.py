"""Fixtures shared by the end-to-end service tests (test_service, test_phoenix)."""

from __future__ import annotations

import pytest
from sglang_publisher import close, publisher
from zmq_ports import free_tcp


@pytest.fixture
def fleet():
    """Two real SGLang publishers, w0 and w1: ({worker: (endpoint, replay)}, {worker: pub})."""
    eps = {w: (free_tcp(), free_tcp()) for w in ("w0", "w1")}
    pubs = {w: publisher(endpoint=ep, replay_endpoint=rep, topic=f"kv@{w}@m") for w, (ep, rep) in eps.items()}
    yield eps, pubs
    for pub in pubs.values():
        close(pub)
