#!/usr/bin/env bash
# One benchmark, old and new code alternating in one sitting (this box is noisy: runs apart in
# time are not comparable). The old code is REV's tree, exported to a temporary directory and
# put first on PYTHONPATH, with this tree's compiled extensions (refused if REV's C sources
# differ); the benchmark script is this tree's, so both sides run the same measurement.
#   usage: bash benchmarks/before_after.sh REV ROUNDS benchmarks/bench_verdict.py [ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
rev=$1 rounds=$2
shift 2
if ! git diff --quiet "$rev" HEAD -- '*.c' '*.h'; then
    echo "the compiled sources differ between $rev and HEAD: rebuild both instead" >&2
    exit 2
fi
old=$(mktemp -d)
trap 'rm -rf "$old"' EXIT
mkdir "$old/kvmiss"
git archive "$rev" | tar -x -C "$old/kvmiss"
for source in $(git ls-files '*.c'); do
    for so in "${source%.c}".*.so; do
        cp "$so" "$old/kvmiss/$so"
    done
done
for round in $(seq "$rounds"); do
    echo "== round $round: before ($(git rev-parse --short "$rev"))"
    PYTHONPATH="$old" .venv/bin/python "$@"
    echo "== round $round: after ($(git rev-parse --short HEAD)$(git diff --quiet || echo ', with uncommitted changes'))"
    .venv/bin/python "$@"
done
