#!/usr/bin/env bash
# The compiled residency table (enricher/_blocktable.c) under AddressSanitizer and
# UndefinedBehaviorSanitizer: rebuild it instrumented, run the tests that drive it hardest
# (differential tests against the reference model, fuzzers, hostile input, retention),
# then put the normal build back.   usage: bash benchmarks/asan_table.sh   (needs gcc, .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
so=$(ls enricher/_blocktable*.so)
backup=$(mktemp)
cp "$so" "$backup"
trap 'cp "$backup" "$so"; rm -f "$backup"' EXIT
include=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['include'])")
gcc -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fPIC -shared -I"$include" \
    enricher/_blocktable.c -o "$so"
LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)" \
ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
KVMISS_REQUIRE_ACCELERATED=1 \
    .venv/bin/python -m pytest -q -p no:cacheprovider tests/enricher/test_residency_table.py tests/fuzz \
    tests/security tests/reliability/test_retention_pruning.py tests/enricher/test_fleet_holders.py \
    tests/enricher/test_evidence.py tests/enricher/test_worked_cases.py tests/enricher/test_offline.py
