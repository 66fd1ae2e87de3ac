"""The real SGLang 0.5.23 KV-event publisher (from PyPI), imported without SGLang's heavy
package initialisers, as shared/reference/PEERS.md describes.

`pip install --no-deps sglang==0.5.23` plus pydantic and psutil (the Makefile's test
environment does this). Only `sglang.srt.disaggregation.kv_events` runs, unmodified.
"""

from __future__ import annotations

import atexit
import importlib.util
import sys
import types

import pytest


def load_kv_events():
    """The real `sglang.srt.disaggregation.kv_events` module, or a pytest skip."""
    if "sglang.srt.disaggregation.kv_events" in sys.modules:
        return sys.modules["sglang.srt.disaggregation.kv_events"]
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang==0.5.23 is not installed (make test installs it)")
    root = spec.submodule_search_locations[0]
    # Bare package objects stand in for the packages whose __init__ pulls in torch & co.
    for name, path in (("sglang", root), ("sglang.srt", f"{root}/srt"),
                       ("sglang.srt.utils", f"{root}/srt/utils")):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [path]
            sys.modules[name] = module
    from sglang.srt.disaggregation import kv_events

    return kv_events


def publisher(*, endpoint: str, replay_endpoint: str | None, dp_rank: int = 0,
              buffer_steps: int = 10_000, topic: str = "kv@pod-a@demo", bind: bool = True):
    """``bind=False``: the PUB connects out to ``endpoint`` (a SUB bound there), as llm-d
    deploys vLLM; the replay ROUTER binds either way."""
    kv_events = load_kv_events()
    return kv_events.ZmqEventPublisher(
        attn_dp_rank=dp_rank, endpoint=endpoint, replay_endpoint=replay_endpoint,
        buffer_steps=buffer_steps, topic=topic, bind=bind,
    )


def close(pub) -> None:
    """Shut a publisher down for good. SGLang registers shutdown() with atexit; a second call
    on a closed publisher waits a full second at interpreter exit for a queue nobody drains."""
    pub.shutdown()
    atexit.unregister(pub.shutdown)


def batch(ts: float, stored=(), removed=(), cleared=False, dp_rank: int = 0):
    """A real SGLang `KVEventBatch` built from its own event classes."""
    kv_events = load_kv_events()
    events = []
    for hashes, parent in stored:
        events.append(kv_events.BlockStored(
            block_hashes=list(hashes), parent_block_hash=parent,
            token_ids=list(range(4 * len(hashes))), block_size=4, lora_id=None,
        ))
    for hashes in removed:
        events.append(kv_events.BlockRemoved(block_hashes=list(hashes)))
    if cleared:
        events.append(kv_events.AllBlocksCleared())
    return kv_events.KVEventBatch(ts=ts, events=events, attn_dp_rank=dp_rank)
