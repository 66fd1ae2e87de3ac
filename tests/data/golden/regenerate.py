"""Rewrites the golden attribution records (<input>.<variant>.expected.jsonl.gz) from the
inputs beside them, with offline attribution as the code now does it.

Run it ONLY when a change of labels (or of any other field of an attribution record) is
deliberate -- never to make tests/golden/test_golden_replay.py pass after a refactor that
was meant to change nothing. The commit that runs it must say in CHANGELOG.md why the
records changed (which inputs, which requests, which fields, and why the new ones are right).

    .venv/bin/python tests/data/golden/regenerate.py            # every case
    .venv/bin/python tests/data/golden/regenerate.py demo-seed7  # the cases of some inputs

It prints, per case, the requests and the count of each label, and how many records changed.
New inputs: make_inputs.py (engine captures, demo runs) and record_harness.py.
"""

from __future__ import annotations

import collections
import gzip
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from golden_cases import cases, expected_path, run_pinned, write_gzip  # noqa: E402


def main(names: list[str]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        run_pinned(Path(tmp), names)
        for name, variant in cases():
            if names and name not in names:
                continue
            errors = Path(tmp) / f"{name}.{variant}.errors"
            if errors.exists():
                print(f"{name} [{variant}]: attribute reported:\n{errors.read_text()}", file=sys.stderr)
                return 1
            records = (Path(tmp) / f"{name}.{variant}.jsonl").read_bytes()
            path = expected_path(name, variant)
            old = gzip.open(path, "rb").read().splitlines() if path.exists() else []
            new = records.splitlines()
            changed = sum(1 for a, b in zip(old, new) if a != b) + abs(len(old) - len(new))
            write_gzip(path, records)
            labels = collections.Counter(json.loads(line)["verdict"]["label"] for line in new)
            print(f"{name} [{variant}]: {len(new)} requests, {changed} records changed; "
                  + ", ".join(f"{k} {v}" for k, v in sorted(labels.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
