"""What the kvmiss vLLM plugin costs the engine, per request.

Three figures, all CPU time (``thread_time`` / ``process_time``: this VM is shared, and CPU
time is what the plugin takes from the engine; wall time would mostly measure the neighbours):

1. *scheduler thread, isolated*: the wrappers' own work per request (two clock reads, a
   `LookupRecord`, the pending-table store, the admission pop and queue append), measured by
   calling the wrapped and the unwrapped methods of one manager whose own work is trivial.
2. *vLLM's real KVCacheManager*: lookup + admission + free of real ``Request`` objects
   (512-token prompts = 16 blocks of 32, sha256 block hashes; every other request repeats the
   one before and hits 15 blocks, the others are cold misses), plain vs wrapped (no export
   thread) vs wrapped with the export thread and a ``BatchSpanProcessor`` live: the
   scheduler thread's CPU time, and the whole process's (spans built and encoded included).
3. *export side alone*: records -> ``ReadableSpan`` (parent from ``traceparent``) ->
   ``BatchSpanProcessor`` -> OTLP protobuf encoding (what the OTLP exporter does before the
   network), for a miss with a 16-hash chain, a cold miss and a hit.

Run with vLLM's venv (kvmiss installed there): ``/work/vllm-venv/bin/python
benchmarks/bench_vllm_plugin.py``. Without vLLM, figure 2 is skipped.
"""

from __future__ import annotations

import gc
import hashlib
import platform
import statistics
import sys
import time

from kvmiss.enricher.service import vllm_plugin as plugin

REQUESTS = 2_000
TOKENS = 512
BLOCK = 32
REPEATS = 9
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class TrivialManager:
    """A manager whose lookup and allocation cost (almost) nothing: only the wrappers show."""

    result = ((), 96, 0)

    def get_computed_blocks(self, request):
        return self.result

    def allocate_slots(self, request, num_new_tokens, **kwargs):
        return ()


class ShapedRequest:
    def __init__(self, rid: str, hashes: list[bytes]):
        self.request_id = rid
        self.num_tokens = TOKENS
        self.block_hashes = hashes
        self.trace_headers = {"traceparent": TRACEPARENT}
        self.num_preemptions = 0
        self.lora_request = None
        self.mm_features = []
        self.cache_salt = None
        self.prompt_embeds = None


def hashes(seed: int) -> list[bytes]:
    return [hashlib.sha256(f"{seed}/{i}".encode()).digest() for i in range(TOKENS // BLOCK)]


def per_request_ns(run, repeats: int = REPEATS) -> float:
    """Best-of-``repeats`` CPU time of this thread in ``run()`` (REQUESTS requests), per request."""
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        gc.disable()
        start = time.thread_time_ns()
        run()
        best = min(best, time.thread_time_ns() - start)
        gc.enable()
    return best / REQUESTS


def isolated() -> tuple[float, float]:
    requests = [ShapedRequest(f"cmpl-{i}-0000beef", hashes(i % 64)) for i in range(REQUESTS)]
    plain = TrivialManager()
    wrapped = TrivialManager()
    queue = plugin.RecordQueue(maxlen=REQUESTS * 2)
    plugin.Recorder(queue).wrap(wrapped)

    def loop(manager):
        def run():
            lookup, allocate = manager.get_computed_blocks, manager.allocate_slots
            for r in requests:
                lookup(r)
                allocate(r, 416)
            queue.drain()
        return run

    return per_request_ns(loop(plain)), per_request_ns(loop(wrapped))


def real_vllm():
    try:
        import torch
        import vllm
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request
    except ImportError:
        return None
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)

    def manager():
        config = KVCacheConfig(num_blocks=4096, kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
        return KVCacheManager(config, max_model_len=TOKENS + 64, scheduler_block_size=BLOCK,
                              hash_block_size=BLOCK, enable_caching=True)

    # Half the prompts are repeats of an earlier one (cache hits of 15 blocks).
    prompts = [[3 + (j * 7 + (i if i % 2 else i - 1 if i else 0) * 13) % 500 for j in range(TOKENS)]
               for i in range(REQUESTS)]
    def fresh_requests(tag):
        return [Request(f"cmpl-{tag}-{i}-0000beef", p, SamplingParams(max_tokens=1), None, block_hasher=hasher,
                        trace_headers={"traceparent": TRACEPARENT}) for i, p in enumerate(prompts)]

    def loop(m, reqs):
        lookup, allocate, free = m.get_computed_blocks, m.allocate_slots, m.free
        for r in reqs:
            blocks, cached, *_ = lookup(r)
            allocate(r, TOKENS - cached, num_new_computed_tokens=cached, new_computed_blocks=blocks)
            free(r)

    # CPU time, not wall time: this VM is shared, and CPU time of the scheduler thread
    # (thread_time) and of the whole process (process_time: + the export and batch-processor
    # threads) is what the plugin takes from the engine.
    results: dict[str, list[tuple[float, float]]] = {"plain": [], "wrapped": [], "wrapped+export thread": []}
    for rep in range(REPEATS):
        for variant in results:
            m = manager()
            reqs = fresh_requests(f"{variant}{rep}")  # block hashes computed here, not timed
            emitter = None
            if variant != "plain":
                queue = plugin.RecordQueue(maxlen=REQUESTS * 2)
                recorder = plugin.Recorder(queue)
                recorder.wrap(m)
                if variant == "wrapped+export thread":
                    from opentelemetry.sdk.resources import Resource
                    from opentelemetry.sdk.trace.export import BatchSpanProcessor

                    emitter = plugin.SpanEmitter(
                        queue, recorder, BatchSpanProcessor(EncodingSink(), schedule_delay_millis=200),
                        resource=Resource.create({}), block_size=BLOCK, dp_rank=0, interval_s=0.005).start()
            gc.collect()
            thread0, process0 = time.thread_time_ns(), time.process_time_ns()
            loop(m, reqs)
            thread1 = time.thread_time_ns()
            if emitter is not None:
                emitter.shutdown(30.0)  # every span built, encoded: its CPU time counts
            process1 = time.process_time_ns()
            results[variant].append(((thread1 - thread0) / REQUESTS, (process1 - process0) / REQUESTS))
    summary = {}
    for variant, runs in results.items():
        summary[variant] = (min(r[0] for r in runs), statistics.median(r[0] for r in runs),
                            min(r[1] for r in runs), statistics.median(r[1] for r in runs))
    return vllm.__version__, summary


class EncodingSink:
    """A SpanExporter that does the OTLP exporter's CPU work (protobuf encoding), then drops."""

    def __init__(self):
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        self._encode = encode_spans
        self.spans = 0

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        self._encode(spans).SerializeToString()
        self.spans += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def export_thread(cached: int) -> tuple[float, float, int]:
    """Per span: (building it on the export thread, + the batch processor's OTLP encoding)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    sink = EncodingSink()
    processor = BatchSpanProcessor(sink, max_queue_size=REQUESTS * 2, max_export_batch_size=512,
                                   schedule_delay_millis=60_000)
    queue = plugin.RecordQueue(maxlen=REQUESTS * 2)
    emitter = plugin.SpanEmitter(queue, plugin.Recorder(queue), processor, resource=Resource.create({}),
                                 block_size=BLOCK, dp_rank=0)
    chains = [hashes(i) for i in range(64)]
    build = total = float("inf")
    for rep in range(REPEATS):
        for i in range(REQUESTS):
            queue.put(plugin.LookupRecord(f"cmpl-{i}-0000beef", 1, 2, TOKENS, cached, chains[i % 64], (),
                                          {"traceparent": TRACEPARENT}))
        gc.collect()
        start = time.process_time_ns()
        emitter.emit_pending()  # span creation on this ("export") thread
        built = time.process_time_ns()
        processor.force_flush(60_000)  # + the batch processor's encoding, on its thread
        build = min(build, built - start)
        total = min(total, time.process_time_ns() - start)
    processor.shutdown()
    return build / REQUESTS, total / REQUESTS, sink.spans


def main() -> int:
    print(f"python {platform.python_version()} on {platform.machine()}, {REQUESTS} requests x "
          f"{TOKENS} tokens ({TOKENS // BLOCK} blocks of {BLOCK}), best of {REPEATS}, CPU time")
    plain, wrapped = isolated()
    print(f"1. scheduler thread, isolated: {plain / 1000:.2f} us -> {wrapped / 1000:.2f} us per request "
          f"(lookup + admission); plugin adds {(wrapped - plain) / 1000:.2f} us")
    real = real_vllm()
    if real is None:
        print("2. skipped: vLLM is not importable here (run with vLLM's venv)")
    else:
        version, results = real
        base_thread, _, base_process, _ = results["plain"]
        print(f"2. vLLM {version} KVCacheManager, lookup + allocate_slots + free per request, CPU time "
              f"(min / median of {REPEATS}):")
        print(f"   {'':<22} {'scheduler thread':>22} {'whole process':>22}")
        for name, (t_min, t_med, p_min, p_med) in results.items():
            extra = "" if name == "plain" else (f"   plugin: +{(t_min - base_thread) / 1000:.2f} us on the scheduler "
                                                f"thread, +{(p_min - base_process) / 1000:.2f} us CPU in all")
            print(f"   {name:<22} {t_min / 1000:9.2f} / {t_med / 1000:7.2f} us {p_min / 1000:9.2f} / "
                  f"{p_med / 1000:7.2f} us{extra}")
    for cached, what in ((480, "a miss after 15 cached blocks (16-hash chain)"), (0, "a cold miss (1 hash)"),
                         (496, "a hit (no chain)")):
        build, total, spans = export_thread(cached)
        print(f"3. export thread, {what}: {build / 1000:.2f} us to build the span, "
              f"{total / 1000:.2f} us with the batch processor's OTLP encoding ({spans} spans)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
