#!/usr/bin/env bash
# The long fuzz run: every atheris target (every parser that reads outside bytes: frames,
# batches and the KV-cache group fields of hybrid engines applied to an index, OTLP protobuf
# and JSON, config, the fleet file, `kvmiss decode` lines) for N seconds each, seeded from
# shared/reference/data and examples/, then the hypothesis properties with a large example
# budget. The defaults take about 80 minutes plus the hypothesis run.
#
#   bash benchmarks/fuzz_long.sh                 # 600 s per target, 5000 examples
#   FUZZ_SECONDS=120 FUZZ_EXAMPLES=1000 bash benchmarks/fuzz_long.sh decode_batch parse_config
#
# Writes under out/fuzz/ (git-ignored; FUZZ_OUT elsewhere): corpus/<target>/ (seeds + what libFuzzer kept; a
# later run resumes from it), <target>.log, and crash-*/timeout-*/oom-* inputs when a target
# breaks its contract. Prints one summary line per target. Exit status 1 if any target
# crashed, hung or ran out of memory, or if the hypothesis run failed.
# A crash input is replayed with:
#   .venv/bin/python tests/fuzz/atheris_targets.py <target> out/fuzz/crash-<sha1>
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
SECONDS_EACH=${FUZZ_SECONDS:-600}
EXAMPLES=${FUZZ_EXAMPLES:-5000}
OUT=${FUZZ_OUT:-out/fuzz}
TARGETS=("$@")
if [ ${#TARGETS[@]} -eq 0 ]; then
    TARGETS=(decode_batch parse_any parse_otlp_json otlp_protobuf parse_config fleet_file apply_batch decode_line)
fi

if ! [ "$SECONDS_EACH" -ge 1 ] 2>/dev/null; then  # libFuzzer reads 0 as "forever"
    echo "FUZZ_SECONDS must be a whole number >= 1" >&2
    exit 2
fi
mkdir -p "$OUT"
"$PY" tests/fuzz/atheris_targets.py --write-corpus "$OUT/corpus" >/dev/null 2>&1 || exit 1

failed=0
for target in "${TARGETS[@]}"; do
    log="$OUT/$target.log"
    "$PY" tests/fuzz/atheris_targets.py "$target" "$OUT/corpus/$target" \
        -max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb=4096 \
        -artifact_prefix="$OUT/" -print_final_stats=1 >"$log" 2>&1
    status=$?
    runs=$(grep -Eo 'Done [0-9]+ runs in [0-9]+ second' "$log" | tail -1)
    cov=$(grep -Eo 'cov: [0-9]+ ft: [0-9]+ corp: [0-9]+' "$log" | tail -1)
    if [ $status -ne 0 ]; then
        failed=1
        echo "$target: FAILED (exit $status): $(grep -Eo '(crash|timeout|oom|leak)-[0-9a-f]+' "$log" | tail -1)  see $log"
    else
        echo "$target: ${runs:-no stats}, $cov, no crash"
    fi
done

KVMISS_FUZZ_EXAMPLES=$EXAMPLES "$PY" -m pytest -q -p no:cacheprovider tests/fuzz tests/security \
    >"$OUT/hypothesis.log" 2>&1 || failed=1
echo "hypothesis ($EXAMPLES examples per property): $(tail -1 "$OUT/hypothesis.log")"
exit $failed
