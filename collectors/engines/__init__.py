"""Engine adapters: what differs between the engines whose KV events kvmiss follows.

Every engine publishes the same three events (schemas/events.py holds their one definition),
but frames, numbers, encodes and spells them its own way. An `EngineAdapter` (base.py) says
how, for one engine; `ADAPTERS` maps a worker's ``[[workers]] engine`` to it (`adapter_for`),
and each worker's stream parses and decodes through its own adapter (collectors/fleet.py).

Media: each adapter lists its wire spellings (`EngineAdapter.media`). The index meets events
of every engine with their wire spellings (the compiled reader keeps them as sent, and
rewriting them per event would cost ingest time), so it canonicalises once per spelling
with `canonical_medium`, which knows every registered engine's.
"""

from __future__ import annotations

from kvmiss.collectors.engines.atom import ATOMAdapter
from kvmiss.collectors.engines.base import CPU, EXTERNAL, GPU, STORAGE, EngineAdapter
from kvmiss.collectors.engines.sglang import SGLangAdapter
from kvmiss.collectors.engines.trtllm import TensorRTLLMAdapter
from kvmiss.collectors.engines.vllm import VLLMAdapter
from kvmiss.schemas.config import ENGINES

ADAPTERS: dict[str, EngineAdapter] = {
    "vllm": VLLMAdapter(), "sglang": SGLangAdapter(), "trtllm": TensorRTLLMAdapter(), "atom": ATOMAdapter()}
"""``[[workers]] engine`` -> its adapter. A new engine: its module here, its entry, and its
name in schemas/config.py `ENGINES` (the config refuses any other)."""

if set(ADAPTERS) != set(ENGINES):  # the config's list and this one must name the same engines
    raise ImportError(f"engine adapters {sorted(ADAPTERS)} differ from schemas.config.ENGINES {sorted(ENGINES)}")

_MEDIA: dict[str | None, str] = {}  # every registered engine's spellings (`canonical_medium`)
for _engine, _adapter in ADAPTERS.items():
    for _raw, _medium in _adapter.media.items():
        if _MEDIA.setdefault(_raw, _medium) != _medium:  # one spelling, one medium, fleet-wide
            raise ImportError(f"engine {_engine!r} reads medium {_raw!r} as {_medium}, another as {_MEDIA[_raw]}")


def canonical_medium(raw: str | None) -> str:
    """GPU / CPU / STORAGE / EXTERNAL; unknown spellings pass through upper-cased."""
    found = _MEDIA.get(raw)
    if found is not None:
        return found
    upper = raw.upper()  # type: ignore[union-attr]
    return _MEDIA.get(upper, upper)


def adapter_for(engine: str) -> EngineAdapter:
    """The adapter of ``engine`` (a ``[[workers]] engine`` value); ValueError listing the
    engines for any other."""
    adapter = ADAPTERS.get(engine)
    if adapter is None:
        raise ValueError(f"unknown engine {engine!r}; engines: {', '.join(ADAPTERS)}")
    return adapter


__all__ = ["ADAPTERS", "CPU", "EXTERNAL", "EngineAdapter", "GPU", "STORAGE", "adapter_for", "canonical_medium"]
