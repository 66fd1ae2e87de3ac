#!/usr/bin/env bash
# Create .phoenix-venv beside .venv and install Arize Phoenix there, once.
#
# Phoenix is a real OTLP trace store with a query API (shared/reference/OTLP.md). It pulls in
# ~880 MB of dependencies that must not mix with kvmiss's own, hence its own venv. Used by
# tests/enricher/service/test_phoenix.py (opt-in: KVMISS_E2E_PHOENIX=1). Idempotent: a venv whose
# `phoenix` command exists is left as it is.
#
#   bash tests/peers/phoenix_venv.sh            # prints the phoenix command's path
#   PHOENIX_SPEC='arize-phoenix==X.Y' bash tests/peers/phoenix_venv.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${PHOENIX_VENV:-$ROOT/.phoenix-venv}"
SPEC="${PHOENIX_SPEC:-arize-phoenix}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/phoenix" ]; then
    echo "installing $SPEC into $VENV (about 880 MB; a few minutes)" >&2
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip >&2
    "$VENV/bin/pip" install -q "$SPEC" >&2
fi
echo "$VENV/bin/phoenix"
