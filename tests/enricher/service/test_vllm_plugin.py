"""The kvmiss vLLM plugin (enricher/service/vllm_plugin.py) and `kvmiss serve` reading its spans.

Pure parts everywhere: span attributes from a lookup record, the bounded queue, the recorder
(pending table, admission, disable-on-error), the export thread with the real OTel SDK. With
vLLM importable (run this file with vLLM's venv: ``/work/vllm-venv/bin/python -m pytest
tests/enricher/service/test_vllm_plugin.py``), the recorder also runs against vLLM's real
``KVCacheManager`` and ``Request``. The last part feeds plugin spans, produced by the SDK and
encoded as OTLP, through the real pipeline together with vLLM-shaped ``llm_request`` spans.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import sys
import types

import pytest
from fleet_builders import PARENT, H, WorkerFeed, removed, stored
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvmiss.enricher.core.attribution import Attributor
from kvmiss.enricher.core.hashing import external_hash
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.enricher.otlp.spans import SpanReader
from kvmiss.enricher.service import vllm_plugin as plugin
from kvmiss.enricher.service.pipeline import Pipeline
from kvmiss.schemas.span_attributes import PREFIX_LOOKUP_SPAN, InputNames

TRACE = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE}-b7ad6b7169203331-01"


def record(cached: int = 32, *, hashes=(b"a" * 32, b"b" * 32, b"c" * 32), n: int = 100,
           kinds=(), headers=None, rid: str = "cmpl-1-abcdef12", start: int = 1_000_000_000_000) -> plugin.LookupRecord:
    return plugin.LookupRecord(rid, start, start + 5_000, n, cached, list(hashes), tuple(kinds),
                               headers if headers is not None else {"traceparent": TRACEPARENT})


# --- pure parts ----------------------------------------------------------------------------------


class TestSpanAttributes:
    def test_names_are_kvmiss_input_names(self):
        defaults = InputNames()
        assert plugin.ATTR_REQUEST_ID == defaults.request_id[0]
        assert plugin.ATTR_PROMPT_TOKENS == defaults.prompt_tokens[0]
        assert plugin.ATTR_CACHED_TOKENS in defaults.cached_tokens
        assert plugin.ATTR_BLOCK_SIZE == defaults.block_size[0]
        assert plugin.ATTR_BLOCK_HASHES == defaults.block_hashes[0]
        assert plugin.ATTR_LOOKUP_TIME == defaults.lookup_time_unix_nano[0]
        assert plugin.ATTR_EXTRA_KEY_KINDS == defaults.extra_key_kinds[0]
        assert plugin.ATTR_DP_RANK == defaults.dp_rank[0]
        assert plugin.ATTR_SKIP_READING == defaults.skip_reading_prefix_cache[0]
        assert plugin.WORKER_RESOURCE_KEY == defaults.resource_worker[0]
        assert plugin.SPAN_NAME == PREFIX_LOOKUP_SPAN

    def test_the_chain_runs_up_to_and_including_the_first_miss(self):
        attrs = plugin.lookup_attributes(record(cached=32), block_size=32, dp_rank=0)
        assert attrs == {
            "gen_ai.request.id": "cmpl-1-abcdef12", "gen_ai.usage.input_tokens": 100,
            "kvmiss.cached_tokens": 32, "kvmiss.block_size": 32,
            "kvmiss.lookup_time_unix_nano": 1_000_000_000_000, "kvmiss.route.dp_rank": 0,
            "kvmiss.block_hashes": [plugin.otel_int(b"a" * 32), plugin.otel_int(b"b" * 32)],
        }

    def test_nothing_missed_needs_no_chain(self):
        # N=100, B=32: the lookup limit is 96 (hit); N=128: 96 too (lookup_limit).
        for n in (100, 128):
            attrs = plugin.lookup_attributes(record(cached=96, n=n, hashes=[b"h" * 32] * 4), block_size=32,
                                             dp_rank=None)
            assert "kvmiss.block_hashes" not in attrs and "kvmiss.route.dp_rank" not in attrs
        attrs = plugin.lookup_attributes(record(cached=64, n=128, hashes=[b"h" * 32] * 4), block_size=32, dp_rank=0)
        assert len(attrs["kvmiss.block_hashes"]) == 3

    def test_extra_key_kinds_and_no_hashes(self):
        attrs = plugin.lookup_attributes(record(cached=0, hashes=(), kinds=("lora", "cache_salt")),
                                         block_size=32, dp_rank=1)
        assert attrs["kvmiss.extra_key_kinds"] == ["lora", "cache_salt"]
        assert "kvmiss.block_hashes" not in attrs and attrs["kvmiss.route.dp_rank"] == 1

    def test_an_over_long_chain_is_left_out_rather_than_cut(self):
        many = [bytes([i % 256]) * 32 for i in range(plugin.MAX_CHAIN_BLOCKS + 1)]
        attrs = plugin.lookup_attributes(record(cached=plugin.MAX_CHAIN_BLOCKS * 16, hashes=many),
                                         block_size=16, dp_rank=0)
        assert "kvmiss.block_hashes" not in attrs

    def test_hashes_travel_as_int64_and_come_back_as_the_engines_uint64(self):
        for text in (b"x", b"y", b"z", b"w"):
            digest = hashlib.sha256(text).digest()
            value = plugin.otel_int(digest)
            assert -(2**63) <= value < 2**63
            assert value & (2**64 - 1) == external_hash(digest) == int.from_bytes(digest[-8:], "big")
        assert plugin.otel_int(2**64 - 1) == -1 and plugin.otel_int(5) == 5

    def test_extra_key_kinds_of_a_request(self):
        class Req:
            lora_request = object()
            mm_features = [object()]
            cache_salt = "s"
            prompt_embeds = None

        assert plugin.extra_key_kinds(Req()) == ("lora", "mm", "cache_salt")

    def test_versions(self):
        assert [plugin.version_supported(v) for v in ("0.29.9", "0.30.0", "0.32.0", "0.33.1rc1", "0.34.0",
                                                       "1.0.0", "garbage")] == [
            False, True, True, True, False, False, False]

    def test_an_unsupported_vllm_is_refused_at_load_with_one_clear_line(self, monkeypatch, caplog):
        module = types.ModuleType("vllm")
        module.__version__ = "0.29.1"
        monkeypatch.setitem(sys.modules, "vllm", module)
        monkeypatch.setattr(plugin, "_registered", False)
        monkeypatch.delenv(plugin.ANY_VERSION_ENV, raising=False)
        with caplog.at_level(logging.INFO, logger="vllm.plugins.kvmiss"):
            plugin.register()
            plugin.register()  # loaded again in the same process: nothing more
        (line,) = [r.getMessage() for r in caplog.records if r.name == "vllm.plugins.kvmiss"]
        assert "vLLM 0.29.1 is not supported (supported: 0.30-0.33" in line and plugin.ANY_VERSION_ENV in line

    def test_worker_template_takes_the_dp_rank(self):
        assert plugin.worker_id("pod-a-dp{dp_rank}", 3) == "pod-a-dp3"
        assert plugin.worker_id("pod-a", 3) == "pod-a" and plugin.worker_id(None, 0) is None


class TestRecordQueue:
    def test_bounded_the_oldest_is_dropped_and_counted(self):
        queue = plugin.RecordQueue(maxlen=3)
        for i in range(5):
            queue.put(record(rid=str(i)))
        assert queue.dropped == 2 and [r.request_id for r in queue.drain()] == ["2", "3", "4"]
        assert len(queue) == 0 and queue.drain() == []

    def test_drain_limit(self):
        queue = plugin.RecordQueue()
        for i in range(4):
            queue.put(record(rid=str(i)))
        assert len(queue.drain(limit=3)) == 3 and len(queue) == 1


# --- the recorder on objects shaped like vLLM's -----------------------------------------------------


class Request:
    """The attributes the plugin reads from vLLM's ``Request`` (vllm/v1/request.py)."""

    def __init__(self, rid: str, tokens: int, hashes, *, preemptions: int = 0):
        self.request_id = rid
        self.num_tokens = tokens
        self.block_hashes = list(hashes)
        self.trace_headers = {"traceparent": TRACEPARENT}
        self.num_preemptions = preemptions
        self.lora_request = None
        self.mm_features = []
        self.cache_salt = None
        self.prompt_embeds = None


class Manager:
    """A KV-cache manager with the two methods the plugin wraps: a dict of cached hashes
    and a pool of ``free`` blocks, returning what vLLM's methods return."""

    def __init__(self, block_size: int = 32, free: int = 8):
        self.block_size = block_size
        self.cached: set[bytes] = set()
        self.free = free
        self.calls = 0

    def get_computed_blocks(self, request):
        self.calls += 1
        n = 0
        for h in request.block_hashes:
            if h not in self.cached or (n + 1) * self.block_size > request.num_tokens - 1:
                break
            n += 1
        return ("blocks",), n * self.block_size, 0

    def allocate_slots(self, request, num_new_tokens, **kwargs):
        need = -(-num_new_tokens // self.block_size)
        if need > self.free:
            return None
        self.cached.update(request.block_hashes)
        return ("new-blocks",)


def hashes(seed: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{seed}{i}".encode()).digest() for i in range(n)]


class TestRecorder:
    def make(self, **kw):
        manager, queue = Manager(**kw), plugin.RecordQueue()
        recorder = plugin.Recorder(queue, clock_ns=iter(range(1000, 10**9, 10)).__next__)
        recorder.wrap(manager)
        return manager, queue, recorder

    def test_a_lookup_is_queued_when_its_request_is_admitted(self):
        manager, queue, recorder = self.make()
        request = Request("r-1", 100, hashes("a", 3))
        assert manager.get_computed_blocks(request)[1] == 0
        assert len(queue) == 0 and "r-1" in recorder.pending
        manager.allocate_slots(request, 100)
        (rec,) = queue.drain()
        assert (rec.request_id, rec.num_tokens, rec.cached_tokens, rec.start_ns, rec.end_ns) == ("r-1", 100, 0, 1000, 1010)
        assert rec.trace_headers == {"traceparent": TRACEPARENT} and not recorder.pending
        again = Request("r-2", 100, hashes("a", 3))
        manager.get_computed_blocks(again)
        manager.allocate_slots(again, 4)
        assert queue.drain()[0].cached_tokens == 96

    def test_a_failed_admission_keeps_nothing_and_the_next_lookup_counts(self):
        manager, queue, recorder = self.make(free=1)
        request = Request("r-1", 100, hashes("a", 3))
        manager.get_computed_blocks(request)
        assert manager.allocate_slots(request, 100) is None
        assert len(queue) == 0 and not recorder.pending
        manager.free = 8
        manager.get_computed_blocks(request)
        manager.allocate_slots(request, 100)
        assert [r.request_id for r in queue.drain()] == ["r-1"]

    def test_decode_allocations_cost_nothing_and_queue_nothing(self):
        manager, queue, recorder = self.make()
        request = Request("r-1", 100, hashes("a", 3))
        for _ in range(3):
            manager.allocate_slots(request, 1)
        assert len(queue) == 0

    def test_lookups_after_a_preemption_are_not_recorded(self):
        manager, queue, recorder = self.make()
        request = Request("r-1", 100, hashes("a", 3), preemptions=1)
        manager.get_computed_blocks(request)
        manager.allocate_slots(request, 100)
        assert len(queue) == 0

    def test_the_pending_table_is_bounded(self):
        manager, queue, _ = self.make()
        recorder = plugin.Recorder(queue, max_pending=2)
        recorder.wrap(Manager())
        for i in range(4):
            recorder.note_lookup(Request(f"r-{i}", 10, ()), (None, 0), 0, 1)
        assert list(recorder.pending) == ["r-2", "r-3"] and recorder.pending_dropped == 2

    def test_an_error_disables_the_plugin_once_and_never_reaches_the_scheduler(self, caplog):
        manager, queue, recorder = self.make()
        broken = Request("r-1", 100, hashes("a", 3))
        del broken.trace_headers  # a vLLM that renamed a field
        with caplog.at_level(logging.WARNING, logger="vllm.plugins.kvmiss"):
            result = manager.get_computed_blocks(broken)
            manager.get_computed_blocks(broken)
        assert result[1] == 0 and not recorder.active
        assert "get_computed_blocks" not in manager.__dict__ and "allocate_slots" not in manager.__dict__
        lines = [r for r in caplog.records if r.name == "vllm.plugins.kvmiss"]
        assert len(lines) == 1 and "disabled" in lines[0].getMessage()
        ok = Request("r-2", 100, hashes("a", 3))
        manager.get_computed_blocks(ok)
        manager.allocate_slots(ok, 100)  # the originals again: nothing recorded
        assert len(queue) == 0 and not recorder.pending

    def test_without_allocate_slots_every_lookup_is_queued(self):
        class LookupOnly:
            def get_computed_blocks(self, request):
                return (), 32, 0

        queue = plugin.RecordQueue()
        recorder = plugin.Recorder(queue)
        manager = LookupOnly()
        recorder.wrap(manager)
        manager.get_computed_blocks(Request("r-1", 100, hashes("a", 3)))
        assert [r.cached_tokens for r in queue.drain()] == [32]


# --- the export side, with the real OTel SDK -------------------------------------------------------


def sdk_processor(worker: str | None = "pod-a"):
    """The SDK's SimpleSpanProcessor into its InMemorySpanExporter, and a resource."""
    exporter = InMemorySpanExporter()
    attrs = {"service.name": "vllm"}
    if worker:
        attrs["kvmiss.worker"] = worker
    return SimpleSpanProcessor(exporter), Resource.create(attrs), exporter


def emitter_for(queue, recorder, processor, resource, dp_rank=0, block_size=32):
    return plugin.SpanEmitter(queue, recorder, processor, resource=resource, block_size=block_size,
                              dp_rank=dp_rank, interval_s=0.01)


class TestSpanEmitter:
    def test_a_record_becomes_a_child_span_of_the_requests_traceparent(self):
        processor, resource, exporter = sdk_processor()
        queue = plugin.RecordQueue()
        emitter = emitter_for(queue, plugin.Recorder(queue), processor, resource)
        queue.put(record(cached=32))
        assert emitter.force_flush()
        (span,) = exporter.get_finished_spans()
        assert span.name == "kvmiss.prefix_lookup"
        assert format(span.context.trace_id, "032x") == TRACE
        assert format(span.parent.span_id, "016x") == "b7ad6b7169203331"
        assert (span.start_time, span.end_time) == (1_000_000_000_000, 1_000_000_005_000)
        assert span.attributes["kvmiss.cached_tokens"] == 32 and span.resource.attributes["kvmiss.worker"] == "pod-a"

    def test_kvmiss_reads_the_encoded_span_back(self):
        processor, resource, exporter = sdk_processor()
        queue = plugin.RecordQueue()
        emitter = emitter_for(queue, plugin.Recorder(queue), processor, resource, dp_rank=2)
        digests = [hashlib.sha256(t).digest() for t in (b"p", b"q", b"r")]
        queue.put(record(cached=32, hashes=digests, kinds=("cache_salt",)))
        emitter.force_flush()
        request = encode_spans(exporter.get_finished_spans())
        reader = SpanReader()
        rs = request.resource_spans[0]
        facts = reader.read(rs.scope_spans[0].spans[0], resource_worker=reader.worker_of(rs.resource.attributes))
        assert facts.engine_lookup and facts.resource_worker == "pod-a" and facts.worker is None
        assert (facts.request_id, facts.prompt_tokens, facts.cached_tokens, facts.block_size, facts.dp_rank) == (
            "cmpl-1-abcdef12", 100, 32, 32, 2)
        assert facts.block_hashes == [external_hash(d) for d in digests[:2]]
        assert facts.lookup_time == 1000.0 and facts.extra_key_kinds == ["cache_salt"]

    def test_traceparent_parsing(self):
        assert plugin.parse_traceparent({"traceparent": TRACEPARENT}) == (int(TRACE, 16), 0xB7AD6B7169203331, 1, None)
        assert plugin.parse_traceparent({"traceparent": TRACEPARENT, "tracestate": "a=1"})[3] == "a=1"
        for bad in ("", "garbage", "ff-" + TRACEPARENT[3:], f"00-{'0' * 32}-b7ad6b7169203331-01",
                    f"00-{TRACE}-{'0' * 16}-01", f"00-{TRACE}-b7ad6b7169203331-01-extra"):
            assert plugin.parse_traceparent({"traceparent": bad}) is None, bad
        assert plugin.parse_traceparent(None) is None and plugin.parse_traceparent({}) is None

    def test_an_unsampled_parent_gets_no_span(self):
        processor, resource, exporter = sdk_processor()
        queue = plugin.RecordQueue()
        emitter = emitter_for(queue, plugin.Recorder(queue), processor, resource)
        queue.put(record(headers={"traceparent": TRACEPARENT[:-2] + "00"}))
        emitter.force_flush()
        assert exporter.get_finished_spans() == () and emitter.unsampled == 1

    def test_a_request_without_traceparent_gets_a_root_span(self):
        processor, resource, exporter = sdk_processor()
        queue = plugin.RecordQueue()
        emitter = emitter_for(queue, plugin.Recorder(queue), processor, resource)
        queue.put(record(headers={}))
        emitter.force_flush()
        assert exporter.get_finished_spans()[0].parent is None

    def test_the_thread_drains_in_the_background_and_shutdown_is_idempotent(self):
        processor, resource, exporter = sdk_processor()
        queue = plugin.RecordQueue()
        emitter = emitter_for(queue, plugin.Recorder(queue), processor, resource).start()
        queue.put(record())
        for _ in range(200):
            if exporter.get_finished_spans():
                break
            asyncio.run(asyncio.sleep(0.01))
        assert len(exporter.get_finished_spans()) == 1 and emitter.emitted == 1
        emitter.shutdown(1.0)
        emitter.shutdown(1.0)

    def test_an_export_side_error_disables_the_plugin(self, caplog):
        class Broken:
            def on_end(self, span):
                raise RuntimeError("exporter gone")

        queue = plugin.RecordQueue()
        recorder = plugin.Recorder(queue)
        emitter = emitter_for(queue, recorder, Broken(), None)
        queue.put(record())
        with caplog.at_level(logging.WARNING, logger="vllm.plugins.kvmiss"):
            assert emitter.emit_pending() is False
        assert not recorder.active and "exporter gone" in caplog.text
        queue.put(record())
        assert emitter.emit_pending() is False and len(queue) == 0


class TestAttach:
    class Config:
        def __init__(self, endpoint="http://127.0.0.1:4317", caching=True):
            self.observability_config = type("O", (), {"otlp_traces_endpoint": endpoint})()
            self.cache_config = type("C", (), {"enable_prefix_caching": caching})()
            self.parallel_config = type("P", (), {"data_parallel_index": 1})()

    class Scheduler:
        def __init__(self, config):
            self.vllm_config = config
            self.block_size = 32
            self.hash_block_size = 32
            self.kv_cache_manager = Manager()

    def test_attach_wraps_the_schedulers_manager_and_exports(self, monkeypatch):
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
        processor, resource, exporter = sdk_processor("w1")
        scheduler = self.Scheduler(self.Config())
        attachment = plugin.attach(scheduler, processor_factory=lambda endpoint, dp_rank: (processor, resource, f"w{dp_rank}"))
        try:
            manager = scheduler.kv_cache_manager
            request = Request("r-1", 100, hashes("a", 3))
            manager.get_computed_blocks(request)
            manager.allocate_slots(request, 100)
            attachment.emitter.force_flush()
            (span,) = exporter.get_finished_spans()
            assert span.attributes["kvmiss.route.dp_rank"] == 1 and attachment.worker == "w1"
        finally:
            attachment.emitter.shutdown(1.0)

    @pytest.mark.parametrize("config", [Config(endpoint=None), Config(caching=False)])
    def test_nothing_to_do_leaves_the_engine_alone(self, config, monkeypatch):
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
        scheduler = self.Scheduler(config)
        assert plugin.attach(scheduler, processor_factory=pytest.fail) is None
        assert "get_computed_blocks" not in scheduler.kv_cache_manager.__dict__


# --- vLLM's own objects (only where vLLM is importable) --------------------------------------------


@pytest.fixture(scope="module")
def vllm_manager_factory():
    pytest.importorskip("vllm", reason="vLLM is not installed in this venv")
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request as VllmRequest

    init_none_hash(sha256)
    hasher = get_request_block_hasher(32, sha256)

    def manager(num_blocks: int = 16):
        spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
        config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
        return KVCacheManager(config, max_model_len=256, scheduler_block_size=32, hash_block_size=32,
                              enable_caching=True)

    def request(rid: str, tokens: list[int]):
        return VllmRequest(rid, tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher,
                           trace_headers={"traceparent": TRACEPARENT})

    return manager, request, maybe_convert_block_hash


class TestWithRealVllm:
    def test_lookups_on_vllms_kv_cache_manager(self, vllm_manager_factory):
        make_manager, make_request, convert = vllm_manager_factory
        manager, queue = make_manager(), plugin.RecordQueue()
        recorder = plugin.Recorder(queue)
        recorder.wrap(manager)
        tokens = list(range(3, 103))  # 100 tokens: 3 full blocks
        shared = tokens[:64] + list(range(200, 236))  # the same first 2 blocks, then others
        for rid, prompt in (("cold-1a2b3c4d", tokens), ("repeat-1a2b3c4d", tokens), ("partial-1a2b3c4d", shared)):
            request = make_request(rid, prompt)
            blocks, cached, *_ = manager.get_computed_blocks(request)
            assert manager.allocate_slots(request, 100 - cached, num_new_computed_tokens=cached,
                                          new_computed_blocks=blocks) is not None
            manager.free(request)
        cold, repeat, partial = queue.drain()
        assert (cold.cached_tokens, repeat.cached_tokens, partial.cached_tokens) == (0, 96, 64)
        assert cold.num_tokens == 100 and cold.trace_headers == {"traceparent": TRACEPARENT}

        def chain(rec):
            return plugin.lookup_attributes(rec, block_size=32, dp_rank=0).get("kvmiss.block_hashes")

        assert chain(repeat) is None  # a hit: nothing to explain
        assert [h & (2**64 - 1) for h in chain(cold)] == [convert(cold.block_hashes[0])]
        assert [h & (2**64 - 1) for h in chain(partial)] == [convert(h) for h in partial.block_hashes[:3]]
        assert chain(partial)[:2] == [plugin.otel_int(h) for h in cold.block_hashes[:2]]
        # vLLM's own requests say whether they skip reading the cache (no prompt logprobs: no)
        assert cold.skip_reading is False and plugin.lookup_attributes(
            cold, block_size=32, dp_rank=0)["kvmiss.skip_reading_prefix_cache"] is False

    def test_a_full_pool_records_no_admission(self, vllm_manager_factory):
        make_manager, make_request, _ = vllm_manager_factory
        manager, queue = make_manager(num_blocks=3), plugin.RecordQueue()
        recorder = plugin.Recorder(queue)
        recorder.wrap(manager)
        request = make_request("big", list(range(3, 203)))
        blocks, cached, *_ = manager.get_computed_blocks(request)
        assert manager.allocate_slots(request, 200, new_computed_blocks=blocks) is None
        assert len(queue) == 0 and not recorder.pending

    def test_register_patches_the_scheduler_once(self, vllm_manager_factory):
        from vllm.v1.core.sched.scheduler import Scheduler

        original = Scheduler.__init__
        try:
            plugin._registered = False
            plugin.register()
            plugin._registered = False
            plugin.register()
            assert Scheduler.__init__._kvmiss_wrapped and Scheduler.__init__.__wrapped__ is original
        finally:
            Scheduler.__init__ = original
            plugin._registered = False


# --- kvmiss serve: the plugin's span + vLLM's llm_request, no router ------------------------------

from test_pipeline import Clock, Sink, attrs  # noqa: E402 (the pipeline tests' small doubles)

CHAIN = [PARENT, H, PARENT + 2]  # 16-token blocks, as in fleet_builders


def lookup_request(*, rid="cmpl-r1-1a2b3c4d", trace=TRACE, cached=16, worker="A", t=1020.5, **record):
    """The plugin's span, produced by the real SDK and encoded as OTLP."""
    processor, resource, exporter = sdk_processor(worker)
    queue = plugin.RecordQueue()
    emitter = emitter_for(queue, plugin.Recorder(queue), processor, resource, dp_rank=0, block_size=16)
    queue.put(plugin.LookupRecord(rid, int(t * 1e9), int(t * 1e9) + 1000, 40, cached,
                                  [h.to_bytes(8, "big") for h in CHAIN], (),
                                  {"traceparent": f"00-{trace}-b7ad6b7169203331-01"}, **record))
    emitter.force_flush()
    return encode_spans(exporter.get_finished_spans())


def llm_request(*, rid="cmpl-r1", trace=TRACE, prompt=40, **extra) -> ExportTraceServiceRequest:
    """vLLM's ``llm_request`` span as the front end exports it (API-level id, no cached tokens)."""
    req = ExportTraceServiceRequest()
    span = req.resource_spans.add().scope_spans.add().spans.add(
        trace_id=bytes.fromhex(trace), span_id=b"\x01" * 8, name=extra.pop("name", "llm_request"),
        start_time_unix_nano=int(1020.0e9))
    for key, value in {"gen_ai.request.id": rid, "gen_ai.usage.prompt_tokens": prompt, **extra}.items():
        kv = span.attributes.add()
        kv.key = key
        if isinstance(value, str):
            kv.value.string_value = value
        elif isinstance(value, float):
            kv.value.double_value = value
        else:
            kv.value.int_value = value
    return req


def evicted_index() -> ResidencyIndex:
    index, a = ResidencyIndex(), WorkerFeed("A", ts0=1000.0)
    for b in a.batches(range(0, 30), {5: [stored(H)], 12: [removed(H)]}):
        index.apply(b)
    return index


def pipeline(clock, **kw):
    sink = Sink()
    return Pipeline(Attributor(evicted_index()), sink, clock=clock, **kw), sink


def labels(sink) -> dict:
    return {s.name: attrs(s).get("kvmiss.label") for s in sink.spans()}


class TestServeReadsPluginSpans:
    @pytest.mark.parametrize("lookup_first", [True, False])
    def test_plugin_span_plus_llm_request_in_either_order(self, lookup_first):
        clock = Clock()
        pipe, sink = pipeline(clock)
        first, second = (lookup_request(), llm_request()) if lookup_first else (llm_request(), lookup_request())
        asyncio.run(pipe.consume(first))
        assert pipe.poll() == 0 and sink.requests == []  # each waits for the other
        clock.t = 2.0
        asyncio.run(pipe.consume(second))
        assert pipe.poll() + pipe.poll() == 1
        assert labels(sink) == {"kvmiss.prefix_lookup": "evicted", "llm_request": None}
        lookup = next(s for s in sink.spans() if s.name == "kvmiss.prefix_lookup")
        a = attrs(lookup)
        assert a["kvmiss.first_miss_block"] == 1 and a["kvmiss.history"] == "continuous"
        assert "kvmiss.block_hashes" not in a  # stripped before export, as for any span
        assert pipe.stats.spans_in == pipe.stats.spans_out == 2 and not pipe._traces

    def test_the_plugin_span_alone_is_judged_after_the_assemble_wait(self):
        clock = Clock()
        pipe, sink = pipeline(clock, assemble_wait_s=3.0)
        asyncio.run(pipe.consume(lookup_request()))
        assert pipe.poll() == 0
        clock.t = 3.0
        assert pipe.poll() == 1 and labels(sink) == {"kvmiss.prefix_lookup": "evicted"}

    def test_a_late_llm_request_is_not_judged_twice(self):
        clock = Clock()
        pipe, sink = pipeline(clock, assemble_wait_s=3.0)
        asyncio.run(pipe.consume(lookup_request()))
        clock.t = 3.0
        pipe.poll()
        asyncio.run(pipe.consume(llm_request()))
        pipe.poll()
        assert labels(sink) == {"kvmiss.prefix_lookup": "evicted", "llm_request": None}
        assert len(sink.spans()) == 2 and pipe.stats.unenriched["request_already_judged"] == 1

    def test_a_late_plugin_span_after_a_judged_router_span_passes_through(self):
        clock = Clock()
        pipe, sink = pipeline(clock)
        router = llm_request(name="router", **{"gen_ai.usage.cache_read.input_tokens": 16,
                                               "kvmiss.route.worker": "A",
                                               "kvmiss.lookup_time_unix_nano": int(1020.5e9)})
        router.resource_spans[0].scope_spans[0].spans[0].attributes.add(key="kvmiss.block_hashes")
        router_span = router.resource_spans[0].scope_spans[0].spans[0]
        for h in CHAIN:
            router_span.attributes[-1].value.array_value.values.add().int_value = h - 2**64 if h >= 2**63 else h
        asyncio.run(pipe.consume(router))
        assert pipe.poll() == 1
        asyncio.run(pipe.consume(lookup_request()))
        pipe.poll()
        assert labels(sink) == {"router": "evicted", "kvmiss.prefix_lookup": None}

    def test_router_facts_win_and_the_verdict_goes_on_the_router_span(self):
        clock = Clock()
        pipe, sink = pipeline(clock)
        # The router says worker A; the plugin's resource names another worker: the route
        # decision stands, the engine's lookup time and chain are used.
        asyncio.run(pipe.consume(lookup_request(worker="pod-elsewhere", cached=16)))
        asyncio.run(pipe.consume(llm_request(name="router", **{"gen_ai.usage.cache_read.input_tokens": 16,
                                                               "kvmiss.route.worker": "A",
                                                               "kvmiss.route.policy": "prefix"})))
        pipe.poll()
        pipe.poll()
        assert labels(sink) == {"router": "evicted", "kvmiss.prefix_lookup": None}
        assert pipe.stats.verdicts and all(key[1:] == ("prefix", "A") for key in pipe.stats.verdicts)

    def test_a_routers_longer_chain_is_used_when_it_reports_more_cached_tokens(self):
        clock = Clock()
        pipe, sink = pipeline(clock)
        router = llm_request(name="router", **{"gen_ai.usage.cache_read.input_tokens": 16,
                                               "kvmiss.route.worker": "A"})
        span = router.resource_spans[0].scope_spans[0].spans[0]
        kv = span.attributes.add()
        kv.key = "kvmiss.block_hashes"
        for h in CHAIN:
            kv.value.array_value.values.add().int_value = h - 2**64 if h >= 2**63 else h
        asyncio.run(pipe.consume(lookup_request(cached=0)))  # the engine's chain: block 0 only
        asyncio.run(pipe.consume(router))
        pipe.poll()
        pipe.poll()
        assert labels(sink) == {"router": "evicted", "kvmiss.prefix_lookup": None}

    def test_the_worker_comes_from_the_resource_only_when_no_span_names_it(self):
        reader = SpanReader()
        req = lookup_request(worker="pod-a")
        rs = req.resource_spans[0]
        span = rs.scope_spans[0].spans[0]
        assert reader.read(span, resource_worker=reader.worker_of(rs.resource.attributes)).resource_worker == "pod-a"
        kv = span.attributes.add()
        kv.key, kv.value.string_value = "kvmiss.route.worker", "router-choice"
        facts = reader.read(span, resource_worker="pod-a")
        assert facts.worker == "router-choice"
        custom = SpanReader(InputNames(resource_worker=["k8s.pod.name"]))
        assert custom.worker_of(rs.resource.attributes) is None

    def test_unrelated_ids_join_when_the_trace_holds_one_request(self):
        clock = Clock()
        pipe, sink = pipeline(clock)
        asyncio.run(pipe.consume(lookup_request(rid="engine-internal-7")))
        asyncio.run(pipe.consume(llm_request(rid="api-id-3")))
        pipe.poll()
        pipe.poll()
        assert labels(sink) == {"kvmiss.prefix_lookup": "evicted", "llm_request": None}

    def test_several_requests_in_one_trace_join_by_id(self):
        clock = Clock()
        pipe, sink = pipeline(clock)
        # One completion call with two prompts: API ids cmpl-x-0 / cmpl-x-1, engine ids with
        # vLLM's suffix. The second one was a hit.
        asyncio.run(pipe.consume(lookup_request(rid="cmpl-x-1-0000beef", cached=32)))
        asyncio.run(pipe.consume(lookup_request(rid="cmpl-x-0-0000cafe", cached=16)))
        asyncio.run(pipe.consume(llm_request(rid="cmpl-x-0", prompt=40)))
        asyncio.run(pipe.consume(llm_request(rid="cmpl-x-1", prompt=40)))
        pipe.poll()
        pipe.poll()
        got = sorted((attrs(s)["gen_ai.request.id"], attrs(s).get("kvmiss.label")) for s in sink.spans())
        assert got == [("cmpl-x-0", None), ("cmpl-x-0-0000cafe", "evicted"), ("cmpl-x-1", None),
                       ("cmpl-x-1-0000beef", "hit")]


def test_a_request_in_full_report_mode_says_so_on_its_lookup_span():
    class Request:
        kv_cache_report_mode = "full"

    assert plugin._report_mode(Request()) == "full"
    assert plugin._report_mode(object()) is None
    record = plugin.LookupRecord("r1", 0, 1, 40, 16, [1, 2, 3], (), None, "full")
    attrs = plugin.lookup_attributes(record, block_size=16, dp_rank=None)
    assert attrs["kvmiss.kv_cache_report_mode"] == "full"
    assert "kvmiss.kv_cache_report_mode" not in plugin.lookup_attributes(record._replace(report_mode=None),
                                                                          block_size=16, dp_rank=None)


def test_whether_a_request_skips_reading_the_prefix_cache_is_on_its_lookup_span():
    """vLLM's `skip_reading_prefix_cache` (prompt logprobs set it): False proves the request
    read the cache even when it hit nothing (kvmiss then applies the engine's hit rule to it)."""
    class Reads:
        skip_reading_prefix_cache = False

    class Skips:
        skip_reading_prefix_cache = True

    assert (plugin._skip_reading(Reads()), plugin._skip_reading(Skips()), plugin._skip_reading(object())) == (
        False, True, None)
    record = plugin.LookupRecord("r1", 0, 1, 40, 0, [1, 2, 3], (), None, None, False)
    assert plugin.lookup_attributes(record, block_size=16, dp_rank=None)["kvmiss.skip_reading_prefix_cache"] is False
    assert "kvmiss.skip_reading_prefix_cache" not in plugin.lookup_attributes(
        record._replace(skip_reading=None), block_size=16, dp_rank=None)


def test_a_hit_in_full_report_mode_carries_the_chain_it_hit():
    """A hit needs no chain for its own label, but in full report mode the engine re-announces
    the chain it hit, and only that chain on the request's span tells the re-announcement from
    a copy (without it, a real-engine run in plugin mode confirmed 8 of 78 re-announced blocks,
    and a later miss needing one of them stayed unknown)."""
    hit = plugin.LookupRecord("r1", 0, 1, 200, 192, list(range(1, 7)), (), None, "full")
    assert plugin.lookup_attributes(hit, block_size=32, dp_rank=None)["kvmiss.block_hashes"] == [1, 2, 3, 4, 5, 6]
    incremental = hit._replace(report_mode=None)
    assert "kvmiss.block_hashes" not in plugin.lookup_attributes(incremental, block_size=32, dp_rank=None)
    miss = hit._replace(cached_tokens=64)
    assert plugin.lookup_attributes(miss, block_size=32, dp_rank=None)["kvmiss.block_hashes"] == [1, 2, 3]


def test_a_full_report_request_not_admitted_keeps_its_earlier_lookups_on_its_span():
    """vLLM looks a waiting request up again each step until its blocks fit, and in full
    report mode every lookup that hit re-announced its hit in that step. The lookup that was
    admitted carries the earlier ones (times, cached tokens), and its chain covers the longest
    of their hits: kvmiss tells each of those re-announcements from a copy."""
    manager, queue = Manager(free=1), plugin.RecordQueue()
    recorder = plugin.Recorder(queue, clock_ns=iter(range(1000, 10**9, 10)).__next__)
    recorder.wrap(manager)
    chain = hashes("p", 4)
    manager.cached.update(chain[:3])
    request = Request("r-1", 130, chain)
    request.kv_cache_report_mode = "full"
    assert manager.get_computed_blocks(request)[1] == 96
    assert manager.allocate_slots(request, 34) is None  # no room: looked up again next step
    manager.cached.discard(chain[2])  # evicted meanwhile: the next lookup hits less
    manager.get_computed_blocks(request)
    manager.free = 8
    manager.allocate_slots(request, 66)
    (rec,) = queue.drain()
    assert rec.cached_tokens == 64 and rec.earlier == ((1000, 96),)
    attrs = plugin.lookup_attributes(rec, block_size=32, dp_rank=None)
    assert attrs["kvmiss.earlier_lookup_times_unix_nano"] == [1000]
    assert attrs["kvmiss.earlier_lookup_cached_tokens"] == [96]
    assert len(attrs["kvmiss.block_hashes"]) == 3  # the earlier hit's three blocks


def test_an_incremental_request_not_admitted_carries_nothing():
    manager, queue = Manager(free=1), plugin.RecordQueue()
    recorder = plugin.Recorder(queue)
    recorder.wrap(manager)
    chain = hashes("q", 3)
    manager.cached.update(chain[:2])
    request = Request("r-1", 100, chain)
    manager.get_computed_blocks(request)
    manager.allocate_slots(request, 40)
    assert not recorder.pending
    manager.free = 8
    manager.get_computed_blocks(request)
    manager.allocate_slots(request, 40)
    (rec,) = queue.drain()
    assert rec.earlier == () and "kvmiss.earlier_lookup_times_unix_nano" not in plugin.lookup_attributes(
        rec, block_size=32, dp_rank=None)


def test_earlier_lookups_are_bounded_to_the_latest():
    recorder = plugin.Recorder(plugin.RecordQueue())
    request = Request("r-1", 100, hashes("b", 3))
    request.kv_cache_report_mode = "full"
    for i in range(plugin.MAX_EARLIER_LOOKUPS + 5):
        recorder.note_lookup(request, (None, 32), i, i + 1)
        recorder.note_admission(request, None)
    record = recorder.pending["r-1"]
    assert len(record.earlier) == plugin.MAX_EARLIER_LOOKUPS
    assert record.earlier[-1] == (plugin.MAX_EARLIER_LOOKUPS + 3, 32)


# --- a hit in full report mode: its re-announcements, told apart by when it looked up ------------


def re_announcing_index() -> ResidencyIndex:
    """[PARENT, H] stored at 5, then stored with no parent at 20 and 21: a request's two
    lookups in full report mode (not admitted at 20), or copies, for all the wire says."""
    index, a = ResidencyIndex(), WorkerFeed("A", ts0=1000.0)
    for b in a.batches(range(0, 30), {5: [stored(PARENT, H)], 20: [stored(PARENT, H)], 21: [stored(PARENT, H)]}):
        index.apply(b)
    return index


def full_report_hit_router() -> ExportTraceServiceRequest:
    return llm_request(name="router", **{"gen_ai.usage.cache_read.input_tokens": 32, "kvmiss.route.worker": "A",
                                         "kvmiss.kv_cache_report_mode": "full"})


class TestFullReportHits:
    def test_a_full_report_hit_waits_for_its_lookup_and_its_lookups_confirm_both_re_announcements(self):
        clock, sink = Clock(), Sink()
        index = re_announcing_index()
        pipe = Pipeline(Attributor(index), sink, clock=clock)
        asyncio.run(pipe.consume(full_report_hit_router()))
        assert pipe.poll() == 0  # a hit needs no index, but which store was its re-announcement?
        asyncio.run(pipe.consume(lookup_request(cached=32, t=1020.5, report_mode="full",
                                                earlier=((int(1019.5e9), 32),))))
        pipe.poll()
        pipe.poll()
        assert labels(sink) == {"router": "hit", "kvmiss.prefix_lookup": None}
        assert index.anomalies[("re_announced_confirmed", "A")] == 4
        assert not index.views("A")[0].unproven_stores

    def test_without_a_lookup_time_it_is_judged_after_the_wait_and_confirms_nothing(self):
        clock, sink = Clock(), Sink()
        index = re_announcing_index()
        pipe = Pipeline(Attributor(index), sink, clock=clock, assemble_wait_s=3.0)
        asyncio.run(pipe.consume(full_report_hit_router()))
        assert pipe.poll() == 0
        clock.t = 3.0
        assert pipe.poll() == 1 and labels(sink) == {"router": "hit"}
        assert index.anomalies[("re_announced_confirmed", "A")] == 0  # no guess at which store
        # the plugin's span, late: its earlier lookup is still told apart (exact, its own step)
        asyncio.run(pipe.consume(lookup_request(cached=32, t=1020.5, report_mode="full",
                                                earlier=((int(1019.5e9), 32),))))
        pipe.poll()
        assert index.anomalies[("re_announced_confirmed", "A")] == 2
        assert list(index.views("A")[0].unproven_stores) == [21]
