"""Engine adapters (collectors/engines): each reads its own engine's captured frames, the
registry and the config refuse an engine that has none, and a worker's ``engine`` picks the
adapter its stream decodes with -- down to the real SGLang publisher on loopback."""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgspec
import pytest
from shared_data import frames, load_json

from kvmiss.collectors import engines
from kvmiss.collectors.continuity import Apply, Hole, HoleReason
from kvmiss.collectors.engines import ADAPTERS, EngineAdapter, adapter_for, canonical_medium
from kvmiss.collectors.engines.sglang import SGLangAdapter
from kvmiss.collectors.engines.vllm import VLLMAdapter
from kvmiss.collectors.fleet import SUB, Fleet
from kvmiss.collectors.frames import BatchMessage, ReplayEnd, scan_batch
from kvmiss.schemas.config import ENGINES, ConfigError, WorkerSpec, parse_config
from kvmiss.schemas.events import MASK64, AllBlocksCleared, BlockRemoved, BlockStored, WireError

DATA = Path(__file__).resolve().parents[1] / "data" / "engines"
VLLM_CAPTURES = sorted(DATA.glob("vllm-*-frames.jsonl"))
MEDIA = {"GPU", "CPU", "STORAGE", "EXTERNAL"}
VLLM, SGLANG = ADAPTERS["vllm"], ADAPTERS["sglang"]


def jsonl_messages(path: Path) -> list[tuple[str, list[bytes]]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(row["source"], frames(row["frames"])) for row in rows]


def parse(adapter: EngineAdapter, channel: str, message: list[bytes]):
    return adapter.frames.live(message) if channel == "live" else adapter.frames.replay(message)


def hashes_sent(event) -> list[int]:
    """Block hashes as the engine sent them, read without kvmiss (either event form), as uint64."""
    hashes = event.get("block_hashes", []) if isinstance(event, dict) else (event[1] if len(event) > 1 else [])
    return [h & MASK64 for h in hashes]


# --- the registry ------------------------------------------------------------------------------


def test_the_registry_serves_every_engine_the_config_accepts():
    assert set(ADAPTERS) == set(ENGINES) == {"vllm", "sglang", "trtllm", "atom"}
    assert isinstance(VLLM, VLLMAdapter) and isinstance(SGLANG, SGLangAdapter)
    assert all(adapter_for(name) is ADAPTERS[name] for name in ENGINES)


def test_an_unknown_engine_is_refused_by_the_registry_listing_the_engines():
    with pytest.raises(ValueError, match=r"unknown engine 'tensorrt'; engines: vllm, sglang, trtllm, atom"):
        adapter_for("tensorrt")


def test_an_unknown_engine_is_refused_by_the_config_naming_the_key_and_the_engines():
    text = '[[workers]]\nid = "w0"\nendpoint = "tcp://127.0.0.1:5557"\nengine = "TensorRT"\n'
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    assert "workers[0] (id 'w0').engine" in str(info.value)
    assert "'TensorRT'" in str(info.value) and "engines: vllm, sglang, trtllm, atom" in str(info.value)


def test_the_engine_defaults_to_vllm_and_sglang_is_accepted():
    base = '[[workers]]\nid = "w0"\nendpoint = "tcp://127.0.0.1:5557"\n'
    assert parse_config(base).workers[0].engine == "vllm"
    assert parse_config(base + 'engine = "sglang"\n').workers[0].engine == "sglang"


def test_every_adapter_starts_at_seq_0_and_spells_only_kvmiss_media():
    for adapter in ADAPTERS.values():
        assert adapter.first_seq == 0  # every publisher's counter (WIRE.md, docs/ENGINES.md)
        assert set(adapter.media.values()) <= MEDIA and adapter.media[None] == "GPU"


def test_canonical_medium_reads_every_engines_spellings_as_the_index_did():
    spelled = [None, "GPU", "gpu", "CPU", "cpu", "CPU_PINNED", "STORAGE", "DISK", "disk", "EXTERNAL", "nvme"]
    assert [canonical_medium(m) for m in spelled] == [
        "GPU", "GPU", "GPU", "CPU", "CPU", "CPU", "STORAGE", "STORAGE", "STORAGE", "EXTERNAL", "NVME"]
    from kvmiss.enricher.core.epoch_residency import canonical_medium as in_index
    assert in_index is canonical_medium  # the index uses this one, no copy of its own
    assert engines._MEDIA == {k: v for a in ADAPTERS.values() for k, v in a.media.items()}


def test_the_compiled_reader_applies_to_both_engines_when_built():
    assert VLLM.scan is scan_batch and SGLANG.scan is scan_batch  # None when not compiled


# --- each adapter reads its engine's captures ---------------------------------------------------


@pytest.mark.parametrize("path", VLLM_CAPTURES, ids=lambda p: p.name)
def test_the_vllm_adapter_decodes_every_captured_release(path):
    checked = 0
    for channel, message in jsonl_messages(path):
        parsed = parse(VLLM, channel, message)
        if isinstance(parsed, ReplayEnd):
            continue
        assert isinstance(parsed, BatchMessage), parsed
        batch = VLLM.decode(parsed.payload)
        sent = msgspec.msgpack.decode(parsed.payload)[1]
        assert [type(e).__name__ for e in batch.events] == [
            e["type"] if isinstance(e, dict) else e[0] for e in sent]
        assert [getattr(e, "block_hashes", []) for e in batch.events] == [hashes_sent(e) for e in sent]
        checked += 1
    assert checked >= 3


def test_the_vllm_adapter_decodes_the_033_reference_capture():
    data = load_json("vllm-0.33.0-event-frames.json")
    checked = 0
    for pub in data["publishers"]:
        messages = [("live", m) for m in pub["live"]]
        messages += [("replay", m) for r in pub["replay"] if r["client_socket"] == "DEALER" for m in r["replies"]]
        for channel, recorded in messages:
            parsed = parse(VLLM, channel, frames(recorded["frames_b64"]))
            if recorded.get("seq") == -1:
                assert isinstance(parsed, ReplayEnd)
                continue
            assert isinstance(parsed, BatchMessage) and parsed.seq == recorded["seq"]
            batch = VLLM.decode(parsed.payload)
            ts, events, rank = recorded["payload_msgpack_untyped"]
            assert (batch.ts, batch.dp_rank, len(batch.events)) == (ts, rank, len(events))
            for event in batch.events:
                if isinstance(event, (BlockStored, BlockRemoved)):
                    assert canonical_medium(event.medium) in MEDIA
                    assert all(0 <= h <= MASK64 for h in event.block_hashes)
            checked += 1
    assert checked >= 15


def sglang_frames() -> list[dict]:
    return [f for f in load_json("sglang-0.5.23-event-frames.json")["frames"] if f["channel"] != "replay-request"]


def test_the_sglang_adapter_decodes_its_captured_frames():
    checked = 0
    for recorded in sglang_frames():
        parsed = parse(SGLANG, "replay" if recorded["channel"] == "replay" else "live", frames(recorded["frames_b64"]))
        decoded = recorded["decoded"]
        if decoded.get("end_of_replay"):
            assert isinstance(parsed, ReplayEnd)
            continue
        assert isinstance(parsed, BatchMessage) and (parsed.topic, parsed.seq) == (decoded["topic"], decoded["seq"])
        batch = SGLANG.decode(parsed.payload)
        ts, events, rank = decoded["payload"]
        assert (batch.ts, batch.dp_rank) == (ts, rank)
        for event, sent in zip(batch.events, events, strict=True):
            assert type(event).__name__ == sent["type"]
            if not isinstance(event, AllBlocksCleared):
                assert event.block_hashes == hashes_sent(sent)  # signed int64 -> two's complement
                assert SGLANG.media[event.medium] in MEDIA  # its own spellings, no upper-casing
        checked += 1
    assert checked >= 12


def test_what_the_compiled_reader_reads_of_sglang_it_reads_as_the_adapter_decodes():
    if SGLANG.scan is None:
        pytest.skip("the compiled reader is not built")
    read = 0
    for recorded in sglang_frames():
        if recorded["decoded"].get("end_of_replay"):
            continue
        channel = "replay" if recorded["channel"] == "replay" else "live"
        payload = parse(SGLANG, channel, frames(recorded["frames_b64"])).payload
        scanned = SGLANG.scan(payload)
        negative = any(h is not None and h < 0 for e in recorded["decoded"]["payload"][1]
                       for h in [*e.get("block_hashes", []), e.get("parent_block_hash")])
        assert (scanned is None) == negative  # a negative hash is the reference's to read
        if scanned is not None:
            ts, rank, events = scanned
            assert list(events) == SGLANG.decode(payload).events and ts == SGLANG.decode(payload).ts
            read += 1
    assert read >= 8


def test_the_sglang_adapter_refuses_positional_array_events_the_vllm_adapter_reads():
    path = next(p for p in VLLM_CAPTURES if p.name.startswith("vllm-0.23"))
    payload = next(m for c, m in jsonl_messages(path) if c == "live")[2]
    assert VLLM.decode(payload).events
    with pytest.raises(WireError, match="event 0: a positional array"):
        SGLANG.decode(payload)


# --- a worker's engine picks its stream's adapter -----------------------------------------------


def collect():
    out: list = []
    return out, lambda worker, action: out.append(action)


def test_a_worker_configured_with_sglang_decodes_through_the_sglang_adapter():
    """Same frames, two workers: the SGLang worker refuses a vLLM 0.23 array-form batch as
    malformed (its adapter's rule), the default (vLLM) worker applies it; both apply SGLang's
    captured batches with canonical hashes."""
    config = parse_config('[[workers]]\nid = "s"\nendpoint = "tcp://127.0.0.1:5557"\nengine = "sglang"\n'
                          '[[workers]]\nid = "v"\nendpoint = "tcp://127.0.0.1:5559"\n')
    actions, sink = collect()
    fleet = Fleet(config.workers, sink)
    assert fleet.streams["s"].adapter is SGLANG and fleet.streams["v"].adapter is VLLM
    live = [frames(f["frames_b64"]) for f in sglang_frames() if f["channel"] == "live"][:4]  # seqs 1-4
    array_form = next(m for c, m in jsonl_messages(next(p for p in VLLM_CAPTURES if "0.23" in p.name)) if c == "live")
    for worker in ("s", "v"):
        for i, message in enumerate(live):
            fleet.on_message(worker, SUB, message, 10.0 + i)
        fleet.on_message(worker, SUB, [array_form[0], (5).to_bytes(8, "big"), array_form[2]], 20.0)
    applied = [a.batch for a in actions if isinstance(a, Apply)]
    s_seqs = [b.seq for b in applied if b.worker == "s"]
    assert s_seqs == [1, 2, 3, 4] and [b.seq for b in applied if b.worker == "v"] == [1, 2, 3, 4, 5]
    stored = next(e for b in applied if b.worker == "s" and b.seq == 2 for e in b.events if isinstance(e, BlockStored))
    assert stored.block_hashes == [2**64 - 5, 2**63 - 1]
    malformed = [a for a in actions if isinstance(a, Hole) and a.reason is HoleReason.MALFORMED]
    assert len(malformed) == 1 and (malformed[0].from_seq, malformed[0].to_seq) == (5, 5)


def test_the_real_sglang_publisher_reaches_a_worker_configured_with_sglang(monkeypatch):
    from sglang_publisher import batch, close, publisher
    from zmq_ports import free_tcp

    from kvmiss.collectors.subscriber import Subscriber

    calls: dict[str, int] = {"vllm": 0, "sglang": 0}
    for name, cls in (("vllm", VLLMAdapter), ("sglang", SGLangAdapter)):
        def counted(self, payload, _decode=cls.decode, _name=name):
            calls[_name] += 1
            return _decode(self, payload)
        monkeypatch.setattr(cls, "decode", counted)
    pub_ep, replay_ep = free_tcp(), free_tcp()
    pub = publisher(endpoint=pub_ep, replay_endpoint=replay_ep)
    actions, sink = collect()
    spec = WorkerSpec(id="w0", endpoint=pub_ep, replay_endpoint=replay_ep, engine="sglang")
    sub = Subscriber(Fleet([spec], sink))
    sub.start()
    try:
        time.sleep(0.3)
        for i in range(5):  # negative hashes: the compiled reader leaves them to the adapter
            pub.publish(batch(1000.0 + i, stored=[([-1 - i, 7 + i], None)]))
            time.sleep(0.01)
        deadline = time.monotonic() + 10
        while sum(isinstance(a, Apply) for a in actions) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        sub.shutdown()
        close(pub)
    applied = [a.batch for a in actions if isinstance(a, Apply)]
    assert [b.seq for b in applied] == list(range(5))
    assert [b.events[0].block_hashes for b in applied] == [[2**64 - 1 - i, 7 + i] for i in range(5)]
    assert calls["sglang"] >= 5 and calls["vllm"] == 0
