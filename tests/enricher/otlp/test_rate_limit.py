"""The intake rate limit: a token bucket over spans in front of the consumer."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from kvmiss.enricher.otlp.interfaces import ACCEPTED, Outcome
from kvmiss.enricher.otlp.receiver import Receivers, SpanRate
from kvmiss.schemas.config import ConfigError, OtlpConfig, parse_config


def request(spans: int) -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    ss = req.resource_spans.add().scope_spans.add()
    for i in range(spans):
        ss.spans.add(trace_id=bytes(15) + bytes([1]), span_id=(i + 1).to_bytes(8, "big"), name="s")
    return req


class Counting:
    def __init__(self):
        self.spans = 0

    async def consume(self, req, body=None, gzipped=None):
        self.spans += sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
        return ACCEPTED


def test_the_bucket_allows_the_rate_and_a_one_second_burst():
    rate = SpanRate(100)
    assert rate.take(60, 0.0) and rate.take(40, 0.0)
    assert not rate.take(10, 0.0)
    assert rate.take(50, 0.5)  # refilled by half a second's worth
    assert rate.wait_s(100) >= 1.0


def test_a_request_bigger_than_a_seconds_worth_is_not_refused_forever():
    rate = SpanRate(100)
    assert rate.take(512, 0.0)
    assert not rate.take(512, 1.0) and rate.take(512, 6.2)


def test_receivers_answer_retryable_beyond_the_rate_and_the_consumer_sees_only_the_rest():
    consumer = Counting()
    receivers = Receivers(OtlpConfig(grpc=None, http=None, max_spans_per_s=150), consumer)
    first = asyncio.run(receivers._deliver(request(100)))
    second = asyncio.run(receivers._deliver(request(100)))
    assert first.outcome is Outcome.ACCEPTED
    assert second.outcome is Outcome.RETRYABLE and second.retry_after_s >= 1.0
    assert consumer.spans == 100 and receivers.stats["requests_rate_limited"] == 1


def test_no_limit_by_default_and_a_negative_one_is_refused():
    assert OtlpConfig().max_spans_per_s == 0
    with pytest.raises(ConfigError, match="max_spans_per_s"):
        parse_config("[otlp]\nmax_spans_per_s = -5\n")
