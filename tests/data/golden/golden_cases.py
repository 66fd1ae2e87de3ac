"""The golden replay cases: each fixed input of this directory, attributed offline under each
variant of the settings that change labels, exactly as `kvmiss attribute` does it
(enricher/cli/attribute_cmd.py: workers from the recording, the recording played into an index
that keeps every epoch, each request record judged at its lookup time).

Files, all gzipped:
  <input>.events.kvrec.gz                 a recording (collectors/recording.py format)
  <input>.requests.jsonl.gz               request records, one `RequestFacts` per line
  <input>.<variant>.expected.jsonl.gz     the attribution records at the commit that wrote them

Shared by tests/golden/test_golden_replay.py (compares) and regenerate.py (rewrites). Both
attribute through `run_pinned` -- this file as a child process with PYTHONHASHSEED set -- and
the test runs it under two seeds: a verdict must not depend on Python's string hashing (it did
once: the fleet view walked a set of worker ids, and the first unresolved one named
``history``).
"""

from __future__ import annotations

import gzip
import io
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kvmiss.enricher.core.privacy import DigestKey
from kvmiss.enricher.service.offline import (
    attribute_requests,
    index_from_recording,
    read_requests,
    workers_in_recording,
)

HERE = Path(__file__).resolve().parent

# A fixed, public key, so the records' first-miss digests are goldened too (never a secret).
DIGEST_KEY = DigestKey("kvmiss-golden: not a deployment secret")

# variant -> ([history] kv_cache_report_mode, [history] aged_out_as_recent_match)
VARIANTS = {
    "any": ("any", False),  # `kvmiss attribute` with no --config
    "incremental": ("incremental", False),  # --kv-cache-report-mode incremental
    "aged-out": ("any", True),  # a config with aged_out_as_recent_match = true
}


def inputs() -> list[str]:
    return sorted(p.name[: -len(".events.kvrec.gz")] for p in HERE.glob("*.events.kvrec.gz"))


def cases() -> list[tuple[str, str]]:
    return [(name, variant) for name in inputs() for variant in VARIANTS]


def expected_path(name: str, variant: str) -> Path:
    return HERE / f"{name}.{variant}.expected.jsonl.gz"


def attribute(name: str, variant: str, workdir: Path) -> tuple[bytes, str]:
    """(attribution records as `kvmiss attribute` writes them, what it said on errors)."""
    mode, aged_out = VARIANTS[variant]
    recording = workdir / f"{name}.kvrec"
    if not recording.exists():
        with gzip.open(HERE / f"{name}.events.kvrec.gz", "rb") as src, open(recording, "wb") as dst:
            shutil.copyfileobj(src, dst)
    workers = workers_in_recording(str(recording))
    index = index_from_recording(str(recording), workers, re_announcements=mode == "any")
    out, errors = io.BytesIO(), io.StringIO()
    with gzip.open(HERE / f"{name}.requests.jsonl.gz", "rb") as requests:
        attribute_requests(index, read_requests(requests), out, digest_key=DIGEST_KEY, errors=errors,
                           aged_out_as_recent_match=aged_out)
    return out.getvalue(), errors.getvalue()


def write_gzip(path: Path, data: bytes) -> None:
    """Byte-stable gzip: no name, no time in the header."""
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as out:
        out.write(data)


HASH_SEED = "0"


def run_pinned(outdir: Path, names: list[str] | None = None, seed: str = HASH_SEED) -> None:
    """Every case (of ``names``' inputs, or all) attributed in a child process with the
    string-hash seed ``seed``, each written to ``outdir/<input>.<variant>.jsonl``; what attribute
    reported on errors, if anything, to ``outdir/<input>.<variant>.errors``."""
    env = {**os.environ, "PYTHONHASHSEED": seed}
    subprocess.run([sys.executable, __file__, str(outdir), *(names or [])], env=env, check=True)


def _main(outdir: str, names: list[str]) -> None:
    assert os.environ.get("PYTHONHASHSEED"), "run through run_pinned"
    out = Path(outdir)
    with tempfile.TemporaryDirectory() as tmp:
        for name, variant in cases():
            if names and name not in names:
                continue
            records, errors = attribute(name, variant, Path(tmp))
            (out / f"{name}.{variant}.jsonl").write_bytes(records)
            if errors:
                (out / f"{name}.{variant}.errors").write_text(errors)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2:])
