#!/usr/bin/env bash
# The compiled parts -- the residency table (enricher/core/_blocktable.c), the span scanner
# (enricher/otlp/_otlpwire.c) and the KV-event reader (collectors/_kvwire.c) -- under AddressSanitizer and UndefinedBehaviorSanitizer: rebuild
# them instrumented, run the tests that drive them hardest (differential tests against the
# reference models, fuzzers, hostile input, retention), then put the normal builds back.
#   usage: bash benchmarks/asan.sh   (needs gcc, .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
include=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['include'])")
backups=()
restore() {
    for pair in "${backups[@]}"; do
        cp "${pair#*:}" "${pair%%:*}"
        rm -f "${pair#*:}"
    done
}
trap restore EXIT
for source in enricher/core/_blocktable.c enricher/otlp/_otlpwire.c collectors/_kvwire.c; do
    so=$(ls "${source%.c}"*.so)
    backup=$(mktemp)
    cp "$so" "$backup"
    backups+=("$so:$backup")
    gcc -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fPIC -shared -I"$include" \
        "$source" -o "$so"
done
LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)" \
ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
KVMISS_REQUIRE_ACCELERATED=1 \
    .venv/bin/python -m pytest -q -p no:cacheprovider tests/enricher/core/test_residency_table.py tests/fuzz \
    tests/security tests/reliability/test_retention_pruning.py tests/enricher/core/test_fleet_holders.py \
    tests/enricher/core/test_evidence.py tests/enricher/core/test_worked_cases.py \
    tests/enricher/service/test_offline.py tests/enricher/otlp/test_span_scan.py \
    tests/enricher/service/test_pipeline.py tests/enricher/otlp/test_receiver.py \
    tests/collectors/test_kvwire.py tests/collectors/test_stream_fast_path.py tests/collectors/test_collector_faults.py
