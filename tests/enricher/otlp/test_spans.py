"""Reading request facts from OTLP spans and writing verdicts back onto them."""

from __future__ import annotations

import msgspec
from opentelemetry.proto.trace.v1 import trace_pb2

from kvmiss.enricher.otlp.spans import SpanReader, strip_raw_inputs, upsert_attributes, verdict_attributes
from kvmiss.schemas import span_attributes as names
from kvmiss.schemas.attribution import (
    History,
    Label,
    Owner,
    TransferResult,
    Verdict,
    WindowStart,
)
from kvmiss.schemas.span_attributes import InputNames


def span(**attrs) -> trace_pb2.Span:
    s = trace_pb2.Span(name="router", start_time_unix_nano=1_000_000_000_000)
    for key, value in attrs.items():
        kv = s.attributes.add()
        kv.key = key.replace("__", ".")
        if isinstance(value, list):
            for item in value:
                v = kv.value.array_value.values.add()
                if isinstance(item, str):
                    v.string_value = item
                else:
                    v.int_value = item
        elif isinstance(value, bool):
            kv.value.bool_value = value
        elif isinstance(value, int):
            kv.value.int_value = value
        elif isinstance(value, float):
            kv.value.double_value = value
        else:
            kv.value.string_value = value
    return s


def attrs_of(s) -> dict:
    out = {}
    for kv in s.attributes:
        kind = kv.value.WhichOneof("value")
        out.setdefault(kv.key, []).append(
            [v.string_value for v in kv.value.array_value.values] if kind == "array_value"
            else getattr(kv.value, kind))
    return out


class TestReading:
    def test_vllms_kv_cache_report_mode_is_read(self):
        f = SpanReader().read(span(gen_ai__request__id="r1", kvmiss__kv_cache_report_mode="full"))
        assert f.kv_cache_report_mode == "full"

    def test_the_plugins_earlier_lookups_are_read_and_become_engine_times_with_their_counts(self):
        from kvmiss.enricher.otlp.assembly import Assembly, Fragment, to_request_facts

        f = SpanReader().read(span(gen_ai__request__id="r1", gen_ai__usage__input_tokens=130, kvmiss__cached_tokens=64,
                                   kvmiss__block_size=32, kvmiss__lookup_time_unix_nano=2_500_000_000,
                                   kvmiss__earlier_lookup_times_unix_nano=[1_500_000_000, 2_000_000_000],
                                   kvmiss__earlier_lookup_cached_tokens=[96, 64]))
        assert f.earlier_lookup_times_unix_nano == [1_500_000_000, 2_000_000_000]
        assert f.earlier_lookup_cached_tokens == [96, 64]
        for times, cached, want, bad in (([1_500_000_000, 2_000_000_000], [96, 64], ((1.5, 96), (2.0, 64)), []),
                                         ([1_500_000_000], [96, 64], (), ["kvmiss.earlier_lookup_times_unix_nano"])):
            assembly = Assembly(b"t" * 16, "r1", 0.0)
            facts = msgspec.structs.replace(f, earlier_lookup_times_unix_nano=times, earlier_lookup_cached_tokens=cached)
            assembly.fragments.append(Fragment(facts, None, None, None, None, None))
            errors: list[str] = []
            got = to_request_facts(assembly, hasher=None, default_block_size=16, errors=errors)
            assert got.earlier_lookups == want and errors == bad

    def test_earlier_lookups_alone_make_no_request(self):
        assert SpanReader().read(span(kvmiss__earlier_lookup_times_unix_nano=[1], kvmiss__earlier_lookup_cached_tokens=[32])) is None

    def test_the_genai_cache_write_count_is_read_under_its_new_and_its_old_name(self):
        for name in ("gen_ai__usage__cache_write__input_tokens", "gen_ai__usage__cache_creation__input_tokens"):
            f = SpanReader().read(span(gen_ai__request__id="r1", gen_ai__usage__input_tokens=100,
                                       gen_ai__usage__cache_read__input_tokens=32, **{name: 68}))
            assert (f.prompt_tokens, f.cached_tokens, f.recomputed_tokens) == (100, 32, 68)
        both = span(gen_ai__usage__cache_write__input_tokens=60, gen_ai__usage__cache_creation__input_tokens=7)
        assert SpanReader().read(both).recomputed_tokens == 60  # the current name wins

    def test_router_span_facts_with_default_names(self):
        s = span(gen_ai__request__id="r1", gen_ai__usage__input_tokens=100,
                 gen_ai__usage__cache_read__input_tokens=32, kvmiss__route__worker="w0",
                 kvmiss__block_hashes=[1, -1, 3], kvmiss__extra_key_kinds=["lora"],
                 kvmiss__lookup_time_unix_nano=1_700_000_000_500_000_000)
        f = SpanReader().read(s)
        assert (f.request_id, f.prompt_tokens, f.cached_tokens, f.worker) == ("r1", 100, 32, "w0")
        assert f.block_hashes == [1, 2**64 - 1, 3]
        assert f.extra_key_kinds == ["lora"]
        assert f.lookup_time == 1_700_000_000.5

    def test_the_first_listed_name_wins_whatever_the_attribute_order(self):
        s = span(gen_ai__usage__prompt_tokens=90, gen_ai__usage__input_tokens=100)
        assert SpanReader().read(s).prompt_tokens == 100

    def test_vllm_llm_request_span_gives_a_lookup_time_from_queue_time(self):
        s = span(gen_ai__request__id="r1", gen_ai__usage__prompt_tokens=7,
                 gen_ai__latency__time_in_queue=0.25)
        f = SpanReader().read(s)
        assert f.prompt_tokens == 7 and f.queue_lookup_time == 1000.25 and f.lookup_time is None

    def test_vllm_llm_request_bounds_its_lookup_by_time_to_first_token_less_prefill(self):
        """Start + time in queue is the earliest the lookup can have been (the engine core
        queued the request after the span started); start + time to first token - prefill
        time the latest (the first token came a prefill after the lookup, and reached the API
        server no earlier)."""
        base = dict(gen_ai__request__id="r1", gen_ai__usage__prompt_tokens=7, gen_ai__latency__time_in_queue=0.25)
        f = SpanReader().read(span(**base, gen_ai__latency__time_to_first_token=0.5,
                                   gen_ai__latency__time_in_model_prefill=0.125))
        assert f.queue_lookup_time == 1000.25 and f.queue_lookup_latest == 1000.375
        sdk = SpanReader().read_attributes({"gen_ai.latency.time_in_queue": 0.25, "gen_ai.usage.prompt_tokens": 7,
                                            "gen_ai.latency.time_to_first_token": 0.5,
                                            "gen_ai.latency.time_in_model_prefill": 0.125}, 1_000_000_000_000)
        assert sdk.queue_lookup_time == 1000.25 and sdk.queue_lookup_latest == 1000.375
        assert SpanReader().read(span(**base, gen_ai__latency__time_to_first_token=0.5)).queue_lookup_latest is None
        contradicting = span(**base, gen_ai__latency__time_to_first_token=0.3, gen_ai__latency__time_in_model_prefill=0.2)
        assert SpanReader().read(contradicting).queue_lookup_latest is None  # before the earliest: no bound
        alone = span(gen_ai__latency__time_to_first_token=0.5, gen_ai__latency__time_in_model_prefill=0.1)
        assert SpanReader().read(alone) is None  # latencies alone make no request

    def test_custom_names_map_a_routers_own_attributes(self):
        reader = SpanReader(InputNames(worker=["router.backend"], cached_tokens=["usage.cached"]))
        f = reader.read(span(router__backend="pod-7", usage__cached=64))
        assert (f.worker, f.cached_tokens) == ("pod-7", 64)

    def test_transfer_spans(self):
        f = SpanReader().read(span(kvmiss__transfer__result="TIMEOUT", kvmiss__transfer__source="CPU"))
        assert f.transfer.result is TransferResult.TIMEOUT and f.transfer.source == "CPU"

    def test_unusable_values_are_skipped_and_named_never_raised(self):
        bad: list[str] = []
        s = span(gen_ai__usage__input_tokens="lots", kvmiss__block_hashes=["x"],
                 kvmiss__transfer__result="exploded", gen_ai__request__id="r9")
        f = SpanReader().read(s, bad)
        assert f.request_id == "r9" and f.prompt_tokens is None and f.block_hashes is None
        assert sorted(bad) == ["gen_ai.usage.input_tokens", "kvmiss.block_hashes",
                               "kvmiss.transfer.result"]

    def test_a_span_without_any_input_reads_as_none(self):
        assert SpanReader().read(span(http__method="GET")) is None

    def test_the_instance_comes_from_the_resource(self):
        resource = span(service__instance__id="pod-3-abc").attributes
        assert SpanReader().instance_of(resource) == "pod-3-abc"


VERDICT = Verdict(label=Label.EVICTED, owner=Owner.PLATFORM, reason="gone", history=History.CONTINUOUS,
                  first_miss_block=2, first_miss_digest="ab12:ffff", missed_tokens=32,
                  eviction_age_ms=1500, holders=0, epoch=3, stored_seq=10, removed_seq=20,
                  extra_key_kinds=("lora",), window_start=WindowStart.EPOCH_START,
                  window_start_ts=100.0)


class TestWriting:
    def test_verdict_attributes_follow_spans_md(self):
        out = verdict_attributes(VERDICT, lookup_time=160.0)
        assert out[names.LABEL] == "evicted" and out[names.OWNER] == "platform"
        assert out[names.FIRST_MISS_BLOCK] == 2 and out[names.MISSED_TOKENS] == 32
        assert out[names.EVICTION_AGE_MS] == 1500 and out[names.HOLDERS] == 0
        assert out[names.EXTRA_KEY_KINDS] == ["lora"] and out[names.WINDOW_SECONDS] == 60.0

    def test_upsert_replaces_instead_of_duplicating(self):
        s = span(kvmiss__label="hit", other="kept")
        upsert_attributes(s, verdict_attributes(VERDICT))
        upsert_attributes(s, verdict_attributes(VERDICT))
        attrs = attrs_of(s)
        assert attrs[names.LABEL] == ["evicted"] and attrs["other"] == ["kept"]
        assert all(len(v) == 1 for v in attrs.values())

    def test_raw_inputs_under_configured_names_are_stripped_too(self):
        reader = SpanReader(InputNames(token_ids=["router.prompt_ids"], block_hashes=["router.chain"]))
        s = span(router__prompt_ids=[1, 2], router__chain=[3], kvmiss__token_ids=[4], keep="me")
        strip_raw_inputs(s, reader.raw_names())
        assert list(attrs_of(s)) == ["keep"]

    def test_raw_inputs_are_stripped_and_block_hashes_by_default(self):
        s = span(kvmiss__token_ids=[1, 2], kvmiss__extra_keys='{"cache_salt": "s"}',
                 kvmiss__block_hashes=[5], keep="me")
        strip_raw_inputs(s, SpanReader().raw_names())
        assert list(attrs_of(s)) == ["keep"]
        s = span(kvmiss__token_ids=[1, 2], kvmiss__block_hashes=[5])
        strip_raw_inputs(s, SpanReader().raw_names(keep_block_hashes=True))
        assert list(attrs_of(s)) == ["kvmiss.block_hashes"]


def test_no_output_name_is_a_prefix_of_another():
    for a in names.OUTPUTS:
        for b in names.OUTPUTS:
            assert a == b or not b.startswith(a), (a, b)

