"""Builds the golden inputs from the real-engine captures and from `kvmiss demo` runs.

* ``engine-<capture>``: every capture in tests/data/engines with requests (``vllm-*.jsonl.gz``),
  as tests/enricher/service/test_real_engine_runs.py replays it: its live messages as a
  recording of worker ``vllm-cpu-0``, and each request as the `RequestFacts` that test builds
  (a full-report hit with no lookup time bounded by its send and answer times; report mode,
  skip flag and earlier lookups as captured).
* ``demo-seed<S>``: the inputs of a demo run (``kvmiss demo --seed S --requests 300 --faults
  all --out DIR``): DIR/events.rec and DIR/requests.jsonl. The live demo is timing-dependent;
  its inputs are fixed here and only their offline attribution is goldened.

No raw prompt material is kept: every BlockStored's token ids (and look-ahead token ids) are
replaced by zeros of the same count, a cache salt by a fixed word, and every string in its
extra keys other than the adapter's name (the demo's cache salts) by a stable stand-in; request records carry
block hashes only (token ids and extra keys, if any, are dropped). The attribution of each
scrubbed input is checked to be byte-identical to that of the original.

    .venv/bin/python tests/data/golden/make_inputs.py [--demo SEED=DIR ...]

Run only to make new inputs (then regenerate.py; CHANGELOG.md says why).
"""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import sys
import tempfile
from pathlib import Path

import msgspec

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from golden_cases import VARIANTS, attribute, write_gzip  # noqa: E402

from kvmiss.collectors.recording import RecordedMessage, RecordingWriter, read_recording  # noqa: E402
from kvmiss.schemas.attribution import RequestFacts  # noqa: E402

ENGINES = HERE.parent / "engines"
WORKER = "vllm-cpu-0"


_PSEUDONYMS: dict[str, str] = {}


def _pseudonym(value):
    """A string in a block's extra keys other than its adapter's name (a cache salt, a
    multimodal hash): one stable stand-in per distinct value, so equal stays equal."""
    if isinstance(value, str):
        return _PSEUDONYMS.setdefault(value, f"extra-key-{len(_PSEUDONYMS)}")
    if isinstance(value, list):
        return [_pseudonym(v) for v in value]
    return value


def _scrub_event(event):
    if isinstance(event, dict) and event.get("type") == "BlockStored":
        event = dict(event)
        if isinstance(event.get("extra_keys"), list):
            lora = event.get("lora_name")
            event["extra_keys"] = [
                [v if v == lora else _pseudonym(v) for v in block] if isinstance(block, list) else _pseudonym(block)
                for block in event["extra_keys"]]
        if isinstance(event.get("token_ids"), list):
            event["token_ids"] = [0] * len(event["token_ids"])
        if isinstance(event.get("lookahead_token_ids"), list):
            event["lookahead_token_ids"] = [[0] * len(b) for b in event["lookahead_token_ids"]]
        if event.get("cache_salt") is not None:
            event["cache_salt"] = "salt"
    elif isinstance(event, list) and event and event[0] == "BlockStored":
        event = list(event)
        if len(event) > 3 and isinstance(event[3], list):
            event[3] = [0] * len(event[3])
    return event


def scrub_frame(frame: bytes) -> bytes:
    """A batch payload with its token ids zeroed; any other frame as it was."""
    try:
        batch = msgspec.msgpack.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return frame
    if not (isinstance(batch, list) and len(batch) >= 2 and isinstance(batch[1], list)):
        return frame
    scrubbed = list(batch)
    scrubbed[1] = [_scrub_event(e) for e in batch[1]]
    return frame if scrubbed == batch else msgspec.msgpack.encode(scrubbed)


def write_input(name: str, messages, requests: list[dict], raw_check: bool = True) -> None:
    """Writes <name>.events.kvrec.gz (scrubbed) and <name>.requests.jsonl.gz; checks that
    the scrubbed input attributes exactly as the original."""
    messages = list(messages)
    _PSEUDONYMS.clear()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        raw, clean = tmp / "raw.kvrec", tmp / "clean.kvrec"
        with RecordingWriter(raw) as w_raw, RecordingWriter(clean) as w_clean:
            for m in messages:
                w_raw.write(m)
                w_clean.write(msgspec.structs.replace(m, frames=[scrub_frame(f) for f in m.frames]))
        lines = b"".join(msgspec.json.encode(_plain(r)) + b"\n" for r in requests)
        write_gzip(HERE / f"{name}.requests.jsonl.gz", lines)
        write_gzip(HERE / f"{name}.events.kvrec.gz", raw.read_bytes())
        if raw_check:
            (tmp / "a").mkdir()
            before = {v: attribute(name, v, tmp / "a") for v in VARIANTS}
        write_gzip(HERE / f"{name}.events.kvrec.gz", clean.read_bytes())
        if raw_check:
            (tmp / "b").mkdir()
            after = {v: attribute(name, v, tmp / "b") for v in VARIANTS}
            assert before == after, f"{name}: scrubbing the token ids changed the attribution"
    print(f"{name}: {len(messages)} messages, {len(requests)} requests")


def _plain(r: dict) -> dict:
    facts = msgspec.convert(r, RequestFacts)  # validates; then no prompt material
    facts = msgspec.structs.replace(facts, token_ids=None, extra_keys=None)
    kept = {k: v for k, v in msgspec.to_builtins(facts).items() if v is not None and v != []}
    return {"request_id": kept.pop("request_id", None), "trace_id": r.get("trace_id"), **kept} if "trace_id" in r else kept


def engine_inputs() -> None:
    for path in sorted(ENGINES.glob("vllm-*.jsonl.gz")):
        rows = [json.loads(line) for line in gzip.open(path, "rt") if line.strip()]
        live = [r for r in rows if r.get("source") == "live"]
        captured = [r["request"] for r in rows if "request" in r]
        if not captured:
            continue
        messages = [RecordedMessage(m["recv_ts"], WORKER, "sub", [base64.b64decode(f) for f in m["frames"]])
                    for m in live]
        stem = path.name[: -len(".jsonl.gz")]
        requests = []
        for i, r in enumerate(captured):  # as test_real_engine_runs.kvmiss_verdicts builds them
            t, latest = r["lookup_time"], r.get("lookup_time_latest")
            if t is None and r.get("full_report") and r["cached_tokens"] >= r["block_size"]:
                t, latest = r["sent_at"], r["done_at"]
            requests.append({
                "request_id": f"{stem}-{i:03d}", "prompt_tokens": r["prompt_tokens"],
                "cached_tokens": r["cached_tokens"], "block_size": r["block_size"], "worker": r["worker"],
                "lookup_time": t, "lookup_time_latest": latest, "block_hashes": r["block_hashes"],
                "kv_cache_report_mode": "full" if r.get("full_report") else None,
                "skip_reading_prefix_cache": r.get("skip_reading_prefix_cache"),
                "earlier_lookups": [list(x) for x in r.get("earlier_lookups") or ()],
            })
        write_input(f"engine-{stem}", messages, requests)


def demo_input(seed: str, directory: Path) -> None:
    messages = list(read_recording(str(directory / "events.rec")))
    requests = [json.loads(line) for line in open(directory / "requests.jsonl") if line.strip()]
    write_input(f"demo-seed{seed}", messages, requests)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--demo", action="append", default=[], metavar="SEED=DIR")
    parser.add_argument("--no-engines", action="store_true")
    args = parser.parse_args()
    if not args.no_engines:
        engine_inputs()
    for item in args.demo:
        seed, directory = item.split("=", 1)
        demo_input(seed, Path(directory))


if __name__ == "__main__":
    main()
