"""Request records (enricher/service/request_records.py): what a line holds and never holds,
read back by `kvmiss attribute`'s reader; the size cap, the queue bound, write errors and
shutdown."""

from __future__ import annotations

import gc
import json
import logging
import time
from array import array

import msgspec
import pytest

from kvmiss.enricher.service.offline import BadRequestLine, read_requests
from kvmiss.enricher.service.request_records import RequestRecords, record_of
from kvmiss.schemas.attribution import RequestFacts, RequestRecord, TransferAttempt, TransferResult
from kvmiss.schemas.prompt import ExtraKeysSpec

SALT = "salt-never-written"
ADAPTER = "/adapters/never-written"


def facts(i: int = 0, **extra) -> RequestFacts:
    fields = dict(
        request_id=f"cmpl-{i}", prompt_tokens=65, cached_tokens=16, block_size=16, worker="w0", dp_rank=0,
        lookup_time=1000.0 + i, block_hashes=[2**64 - 1, 7, 9, 11], extra_key_kinds=("cache_salt", "lora"),
        transfers=(TransferAttempt(TransferResult.FAILED, "w1"),), instance_hint="vllm-0", route_policy="prefix",
        predicted_cached_tokens=32, finish_time=1001.5 + i, output_tokens=40, kv_cache_report_mode="full",
        earlier_lookups=((999.5 + i, 32),),
        token_ids=[4242, 4343] * 32 + [99], extra_keys=_extra_keys())
    fields.update(extra)
    return RequestFacts(**fields)


def _extra_keys() -> ExtraKeysSpec:
    return msgspec.json.decode(json.dumps({"cache_salt": SALT, "lora": {"name": "ad", "path": ADAPTER}}),
                               type=ExtraKeysSpec)


def read_back(path) -> list[RequestFacts]:
    with open(path, "rb") as lines:
        out = list(read_requests(lines))
    assert not [x for x in out if isinstance(x, BadRequestLine)]
    return out


def test_a_record_is_the_requests_facts_without_its_prompt_material_and_reads_back_as_them(tmp_path):
    path = tmp_path / "requests.jsonl"
    records = RequestRecords(str(path))
    records.start()
    original = facts()
    records.put(original, trace_id=bytes(range(16)))
    assert records.shutdown()
    (back,) = read_back(path)
    assert back == msgspec.structs.replace(original, token_ids=None, extra_keys=None)
    line = json.loads(path.read_text())
    assert line["trace_id"] == bytes(range(16)).hex()
    assert line["block_hashes"] == [2**64 - 1, 7, 9, 11]  # what the engines publish: needed to replay
    assert records.written == 1 and records.dropped == {}


def test_no_token_id_salt_or_adapter_path_is_ever_written(tmp_path):
    path = tmp_path / "requests.jsonl"
    records = RequestRecords(str(path))
    records.start()
    for i in range(20):
        records.put(facts(i))
    records.shutdown()
    text = path.read_text()
    assert len(text.splitlines()) == 20
    for secret in (SALT, ADAPTER, "4242", "4343", "token_ids", "extra_keys"):
        assert secret not in text


def test_a_record_has_no_field_for_prompt_material_by_construction():
    """A prompt field added to RequestFacts must be added to the record deliberately."""
    facts_fields = set(RequestFacts.__struct_fields__)
    record_fields = set(RequestRecord.__struct_fields__)
    assert record_fields == facts_fields - {"token_ids", "extra_keys"} | {"trace_id"}


def test_a_chain_read_from_the_wire_is_written_as_numbers(tmp_path):
    path = tmp_path / "requests.jsonl"
    records = RequestRecords(str(path))
    records.put(facts(block_hashes=array("Q", [2**64 - 1, 3])))  # as the C scanner hands it over
    records.shutdown()  # never started: written on the caller's thread
    assert json.loads(path.read_text())["block_hashes"] == [2**64 - 1, 3]
    assert record_of(facts(request_id=None, worker=None, transfers=())).request_id is None
    assert set(json.loads(msgspec.json.encode(record_of(RequestFacts(prompt_tokens=1, cached_tokens=0,
                                                                      block_size=16))))) == {
        "prompt_tokens", "cached_tokens", "block_size"}  # what is not known is left out


def test_the_file_is_rotated_before_it_would_pass_max_bytes_and_one_old_file_is_kept(tmp_path):
    path = tmp_path / "requests.jsonl"
    records = RequestRecords(str(path), max_bytes=1 << 20)
    records.start()
    chain = list(range(2**60, 2**60 + 64))
    line = len(msgspec.json.encode(record_of(facts(block_hashes=chain)))) + 1
    total = 3 * (1 << 20) // line + 10  # three files' worth
    for i in range(total):
        records.put(facts(i, block_hashes=chain, request_id="cmpl-x"))
        if i % 500 == 0:
            assert records.force_flush()
    assert records.shutdown()
    rotated = tmp_path / "requests.jsonl.old"
    assert records.rotations >= 2 and sorted(p.name for p in tmp_path.iterdir()) == ["requests.jsonl",
                                                                                      "requests.jsonl.old"]
    for p in (path, rotated):
        assert 0 < p.stat().st_size <= 1 << 20
        assert all(isinstance(x, RequestFacts) for x in read_back(p))  # whole lines only
    newest = read_back(path)
    assert newest[-1].lookup_time == 1000.0 + total - 1  # the latest records are in the current file
    assert records.written == total and records.dropped == {}


def test_beyond_the_queue_bound_records_are_dropped_and_counted(tmp_path):
    records = RequestRecords(str(tmp_path / "r.jsonl"), max_pending=3)  # no writer thread yet
    assert [records.put(facts(i)) for i in range(5)] == [True, True, True, False, False]
    assert records.dropped == {"queue_full": 2} and records.queued == 3
    records.shutdown()
    assert records.written == 3
    assert not records.put(facts()) and records.dropped["shut_down"] == 1
    assert records.shutdown()  # idempotent


def test_write_errors_are_counted_and_logged_once(caplog):
    records = RequestRecords("/dev/full")  # every write: no space left
    records.start()
    with caplog.at_level(logging.WARNING, logger="kvmiss.request_records"):
        for i in range(3):
            records.put(facts(i))
            records.force_flush()
        records.shutdown()
    assert records.errors == 3 and records.dropped == {"write_error": 3} and records.written == 0
    warnings = [r for r in caplog.records if r.name == "kvmiss.request_records"]
    assert len(warnings) == 1 and "/dev/full" in warnings[0].getMessage()
    assert SALT not in caplog.text and "4242" not in caplog.text


def test_a_path_that_cannot_be_opened_fails_at_start(tmp_path):
    with pytest.raises(OSError, match="export.request_records: cannot open .*no-such-dir"):
        RequestRecords(str(tmp_path / "no-such-dir" / "r.jsonl")).start()
    with pytest.raises(ValueError, match="max_bytes"):
        RequestRecords(str(tmp_path / "r.jsonl"), max_bytes=1000)


def test_records_are_handed_to_the_writer_in_batches_without_waiting_for_a_flush(tmp_path):
    from kvmiss.enricher.service import request_records

    records = RequestRecords(str(tmp_path / "r.jsonl"))
    records.start()
    for i in range(request_records.FLUSH_RECORDS - 1):
        records.put(facts(i))
    assert records.queued == request_records.FLUSH_RECORDS - 1 and records.written == 0  # kept, not encoded yet
    records.put(facts(-1))  # the batch is full: encoded and handed over at once
    deadline = time.monotonic() + 5
    while records.written < request_records.FLUSH_RECORDS and time.monotonic() < deadline:
        time.sleep(0.01)
    assert records.written == request_records.FLUSH_RECORDS and records.queued == 0
    assert not gc.is_tracked(record_of(facts()))  # thousands may wait: none is the cyclic GC's work
    records.shutdown()
