"""Coverage-guided fuzz targets (atheris, i.e. libFuzzer driving Python) for every parser that
reads outside bytes. Not collected by pytest (no ``test_`` prefix); run by hand or by
benchmarks/fuzz_long.sh:

    .venv/bin/python tests/fuzz/atheris_targets.py --write-corpus out/fuzz/corpus
    .venv/bin/python tests/fuzz/atheris_targets.py decode_batch out/fuzz/corpus/decode_batch \\
        -max_total_time=300 -timeout=10 -rss_limit_mb=4096 -artifact_prefix=out/fuzz/

Each target calls the parser and lets through only the documented outcome (a value, or the
parser's documented error type); anything else propagates, so libFuzzer stops and writes the
input as ``crash-<sha1>`` (reproduce: run the same command with that file instead of the
corpus directory). The seed corpus comes from the real engine captures and hash vectors in
shared/reference/data plus examples/kvmiss.toml.

Targets:
  decode_batch     msgpack KV-event batch payloads (WireError)
  parse_any        multipart frames (framing below) -> message or FrameError; batches decoded
  parse_otlp_json  OTLP/JSON bodies (ValueError), then the span reader on what parsed
  otlp_protobuf    OTLP protobuf bodies (DecodeError), then the span reader on what parsed and
                   the compiled wire scanner on the same bytes (the reader's answer or none)
  parse_config     TOML configuration text (ConfigError)
  fleet_file       a `[fleet] file` (TOML `workers = [...]`, parse_fleet_file: ConfigError)
  apply_batch      a decoded batch (WireError) applied to a residency index three times, then
                   a request judged on each block it named: the KV-cache group fields of
                   hybrid engines (group_idx, kv_cache_spec_kind, its sliding window) reach
                   the index's per-group tables and hit rules; never an exception
  decode_line      one `kvmiss decode` input line (never raises)

``parse_any`` input framing: byte 0 = frame count (mod 8), byte 1 = socket kind (mod 4:
none, "sub", "dealer", "bogus"), then per frame but the last a 2-byte big-endian length and
the frame; the last frame is the rest.
"""

from __future__ import annotations

import base64
import json
import struct
import sys
from pathlib import Path

import atheris
import msgspec

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]  # tests/: shared_data

with atheris.instrument_imports(include=["kvmiss", "tomllib", "google.protobuf.json_format"]):
    import tomllib  # noqa: F401 (instrumented for parse_config's coverage)

    from google.protobuf import json_format  # noqa: F401
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from kvmiss.collectors.frames import BatchMessage, FrameError, ReplayEnd, parse_any
    from kvmiss.enricher.cli import decode_cmd
    from kvmiss.enricher.core.attribution import Attributor
    from kvmiss.enricher.core.index import ResidencyIndex
    from kvmiss.enricher.otlp.receiver import drop_invalid_spans, parse_otlp_json
    from kvmiss.enricher.otlp.spans import WIRE_SCAN, SpanReader
    from kvmiss.schemas.attribution import RequestFacts
    from kvmiss.schemas.config import Config, ConfigError, WorkerSpec, parse_config, parse_fleet_file
    from kvmiss.schemas.events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        EventBatch,
        WireError,
        decode_batch,
        event_to_builtins,
    )
    from kvmiss.schemas.stream import AppliedBatch, RunStart

from wire_scan_check import check_against_reference  # noqa: E402 (tests/ is on the path now)

SOCKETS = (None, "sub", "dealer", "bogus")
_reader = SpanReader()
_drop = _reader.raw_names()


def _read_spans(request: ExportTraceServiceRequest) -> None:
    drop_invalid_spans(request)
    for rs in request.resource_spans:
        _reader.instance_of(rs.resource.attributes)
        for ss in rs.scope_spans:
            for span in ss.spans:
                _reader.read(span, [])


def fuzz_decode_batch(data: bytes) -> None:
    try:
        batch = decode_batch(data)
    except WireError:
        return
    assert isinstance(batch, EventBatch)
    for event in batch.events:
        for raw in (False, True):
            try:
                json.dumps(event_to_builtins(event, include_raw=raw), default=str)
            except WireError:
                pass


def split_frames(data: bytes) -> tuple[list[bytes], str | None]:
    if len(data) < 2:
        return [], None
    count, socket, rest = data[0] % 8, SOCKETS[data[1] % 4], data[2:]
    frames = []
    for _ in range(max(0, count - 1)):
        if len(rest) < 2:
            break
        (n,), rest = struct.unpack(">H", rest[:2]), rest[2:]
        frames.append(rest[:n])
        rest = rest[n:]
    if count:
        frames.append(rest)
    return frames, socket


def join_frames(frames: list[bytes], socket: str | None) -> bytes:
    out = bytes([len(frames), SOCKETS.index(socket)])
    for frame in frames[:-1]:
        out += struct.pack(">H", len(frame)) + frame
    return out + (frames[-1] if frames else b"")


def fuzz_parse_any(data: bytes) -> None:
    frames, socket = split_frames(data)
    message = parse_any(frames, socket)
    assert isinstance(message, (BatchMessage, ReplayEnd, FrameError))
    if isinstance(message, BatchMessage):
        try:
            message.decode()
        except WireError:
            pass


def fuzz_parse_otlp_json(data: bytes) -> None:
    try:
        request = parse_otlp_json(data)
    except ValueError:
        return
    _read_spans(request)


def fuzz_otlp_protobuf(data: bytes) -> None:
    try:
        request = ExportTraceServiceRequest.FromString(data)
    except DecodeError:
        return
    if WIRE_SCAN:  # the compiled scanner on the same bytes: the reference's answer, or none
        check_against_reference(_reader, _drop, data, may_abstain=True)
    _read_spans(request)


def fuzz_parse_config(data: bytes) -> None:
    text = data.decode("utf-8", "replace")
    try:
        config = parse_config(text)
    except ConfigError:
        return
    assert isinstance(config, Config)
    repr(config)


def fuzz_fleet_file(data: bytes) -> None:
    text = data.decode("utf-8", "replace")
    try:
        workers = parse_fleet_file(text)
    except ConfigError:
        return
    assert all(isinstance(w, WorkerSpec) for w in workers)
    repr(workers)


def fuzz_apply_batch(data: bytes) -> None:
    try:
        batch = decode_batch(data)
    except WireError:
        return
    index = ResidencyIndex(["w0", "w1"], retention_s=1.0, aged_out_horizon_s=2.0)
    keys: list[int] = []
    for seq in range(3):  # the same step three times, a second apart: stores, removals, clears again
        for worker in ("w0", "w1"):
            index.apply(AppliedBatch(worker=worker, epoch=0, seq=seq, ts=100.0 + seq, recv_ts=100.0 + seq,
                                     events=batch.events, run_start_seq=0, run_start=RunStart.EPOCH_START))
        index.prune(100.0 + seq)
    for event in batch.events:
        keys += getattr(event, "block_hashes", [])[:4]
    attributor = Attributor(index)
    for key in keys[:8]:
        for t in (100.5, 101.5, 102.5):
            attributor.attribute(RequestFacts(prompt_tokens=48, cached_tokens=16, block_size=16, worker="w0",
                                              lookup_time=t, block_hashes=[keys[0], key, 7]))


def fuzz_decode_line(data: bytes) -> None:
    for raw in (False, True):
        out = decode_cmd.decode_line(data, include_raw=raw)
        decode_cmd._encoder.encode(out)


TARGETS = {
    "decode_batch": fuzz_decode_batch,
    "parse_any": fuzz_parse_any,
    "parse_otlp_json": fuzz_parse_otlp_json,
    "otlp_protobuf": fuzz_otlp_protobuf,
    "parse_config": fuzz_parse_config,
    "decode_line": fuzz_decode_line,
    "fleet_file": fuzz_fleet_file,
    "apply_batch": fuzz_apply_batch,
}


# --- seed corpus -----------------------------------------------------------------------


def seed_corpus() -> dict[str, list[bytes]]:
    """Seeds per target from shared/reference/data and examples/kvmiss.toml."""
    from shared_data import shared_dir

    data_dir = shared_dir() / "reference" / "data"
    vllm = json.loads((data_dir / "vllm-0.33.0-event-frames.json").read_text())
    sglang = json.loads((data_dir / "sglang-0.5.23-event-frames.json").read_text())
    vectors = json.loads((data_dir / "vllm-0.33.0-hash-vectors.json").read_text())
    messages: list[tuple[list[bytes], str]] = []
    for pub in vllm["publishers"]:
        messages += [([base64.b64decode(f) for f in m["frames_b64"]], "sub") for m in pub["live"]]
        for replay in pub["replay"]:
            messages += [([base64.b64decode(f) for f in r["frames_b64"]], "dealer") for r in replay["replies"]]
    for m in sglang["frames"]:
        if m["channel"] != "replay-request":
            messages.append(([base64.b64decode(f) for f in m["frames_b64"]],
                             "dealer" if m["channel"] == "replay" else "sub"))
    payloads = sorted({frames[-1] for frames, _ in messages if frames and frames[-1]})

    requests = []
    for case in vectors["cases"]:
        request = ExportTraceServiceRequest()
        span = request.resource_spans.add().scope_spans.add().spans.add(
            trace_id=bytes(range(16)), span_id=bytes(range(8)), name="llm_request")
        lora = case["lora_request"]
        extra_keys = json.dumps({
            "lora": {"name": lora["lora_name"], "path": lora["lora_path"]} if lora else None,
            "cache_salt": case["cache_salt"],
            "mm": [{"id": m["identifier"], "offset": m["offset"], "length": m["length"]} for m in case["mm_features"]]})
        for key, value in (("gen_ai.request.id", case["id"]), ("kvmiss.route.worker", "w0"),
                           ("kvmiss.extra_keys", extra_keys)):
            kv = span.attributes.add()
            kv.key, kv.value.string_value = key, value
        for key, value in (("gen_ai.usage.prompt_tokens", case["num_tokens"]),
                           ("gen_ai.usage.cache_read.input_tokens", case["block_size"]),
                           ("kvmiss.lookup_time_unix_nano", 1_700_000_000_000_000_000)):
            kv = span.attributes.add()
            kv.key, kv.value.int_value = key, value
        for key, ints in (("kvmiss.token_ids", case["token_ids"]),
                          ("kvmiss.block_hashes", [h - (1 << 64) if h >= 1 << 63 else h
                                                   for h in case["results"][1]["block_hashes_external_int"]])):
            kv = span.attributes.add()
            kv.key = key
            for i in ints:
                kv.value.array_value.values.add().int_value = i
        requests.append(request)

    from kvmiss.enricher.otlp.exporter import to_otlp_json

    example = (HERE.parents[1] / "examples" / "kvmiss.toml").read_bytes()
    fleet_example = (HERE.parents[1] / "examples" / "fleet.toml").read_bytes()
    hybrid = [msgspec.msgpack.encode(batch) for batch in hybrid_batches()]
    return {
        "decode_batch": payloads,
        "parse_any": [join_frames(frames, socket) for frames, socket in messages]
                     + [join_frames(frames, None) for frames, _ in messages],
        "parse_otlp_json": [to_otlp_json(r).encode() for r in requests],
        "otlp_protobuf": [r.SerializeToString() for r in requests],
        "parse_config": [example, b"[otlp]\ngrpc = ':0'\n[[workers]]\nid = 'a'\nendpoint = 'tcp://h:5557'\ndp_rank = 1\n"],
        "fleet_file": [fleet_example, b"workers = []\n",
                       b"[[workers]]\nid = 'a'\nendpoint = 'tcp://h:5557'\ndp_rank = 1\ntopic = 'kv@a@m'\n"],
        "apply_batch": payloads + hybrid,
        "decode_line": [json.dumps({"frames": [base64.b64encode(f).decode() for f in frames], "socket": socket}).encode()
                        for frames, socket in messages],
    }


def hybrid_batches() -> list[EventBatch]:
    """Batches of a hybrid engine: a full-attention group and a sliding-window group (and an
    unmodelled kind), stores with their spec fields, removals per group, a reset."""
    full = dict(kv_cache_spec_kind="full_attention", group_idx=0)
    window = dict(kv_cache_spec_kind="sliding_window", group_idx=1, kv_cache_spec_sliding_window=64)
    chain = [11, 12, 13, 14]
    return [
        EventBatch(ts=1.0, events=[BlockStored(block_hashes=chain, block_size=16, **full),
                                   BlockStored(block_hashes=chain, block_size=16, **window)]),
        EventBatch(ts=2.0, events=[BlockRemoved(block_hashes=chain[:2], group_idx=1),
                                   BlockStored(block_hashes=[15], parent_block_hash=14, block_size=16,
                                               kv_cache_spec_kind="mamba", group_idx=2, medium="CPU"),
                                   BlockRemoved(block_hashes=[11], group_idx=0)]),
        EventBatch(ts=3.0, events=[AllBlocksCleared(), BlockStored(block_hashes=chain, block_size=16,
                                                                   kv_cache_spec_kind="chunked_local_attention",
                                                                   group_idx=3)]),
    ]


def write_corpus(root: Path) -> None:
    import hashlib

    for target, seeds in seed_corpus().items():
        directory = root / target
        directory.mkdir(parents=True, exist_ok=True)
        for seed in seeds:
            (directory / hashlib.sha1(seed).hexdigest()).write_bytes(seed)
        print(f"{target}: {len(seeds)} seeds in {directory}")


def main(argv: list[str]) -> None:
    if len(argv) >= 3 and argv[1] == "--write-corpus":
        write_corpus(Path(argv[2]))
        return
    if len(argv) < 2 or argv[1] not in TARGETS:
        sys.exit(f"usage: {argv[0]} {{{','.join(TARGETS)}}} [libFuzzer args] [corpus dirs]\n"
                 f"       {argv[0]} --write-corpus DIR")
    target = TARGETS[argv[1]]
    atheris.Setup([argv[0], *argv[2:]], target)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
