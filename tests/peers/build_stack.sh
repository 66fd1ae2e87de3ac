#!/usr/bin/env bash
# Builds the observability stack's Go peers for tests/stack: the OpenTelemetry Collector
# distribution of tests/peers/otelcol and Jaeger v2 (tests/peers/jaeger), each from its pinned
# go.mod/go.sum, once per machine, into a cache outside the work tree:
#     ${KVMISS_PEERS_CACHE:-~/.cache/kvmiss-peers}/<name>-<key>/<name>
# <key> hashes the module's go.mod, go.sum and *.go (tests/stack/stack.py computes the same),
# so a changed pin builds anew and an unchanged one costs nothing. Prints each binary's path.
# Prometheus comes from Debian instead: apt-get install -y prometheus.
# Helm v4 (tests/peers/helm) is built the same way for tests/deploy/test_helm_chart.py; so are,
# only when named, Kubernetes' kube-apiserver and etcd (tests/peers/kube-apiserver, one module:
# ~20 minutes on 2 cores) for that test's opt-in server-side dry-run.
#   bash tests/peers/build_stack.sh            # otelcol, jaeger, helm
#   bash tests/peers/build_stack.sh kube-apiserver etcd
#   bash tests/peers/build_stack.sh otelcol    # one
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=${KVMISS_PEERS_CACHE:-$HOME/.cache/kvmiss-peers}
# Two shared cores: at most two compile jobs, at low priority.
export GOFLAGS="${GOFLAGS:--p=2}"
command -v go >/dev/null || { echo "build_stack.sh: no 'go' on PATH (Go >= 1.26 is needed)" >&2; exit 1; }

key() {  # the same bytes, in the same order, as stack.py's module_key()
    (cd "$1" && cat go.mod go.sum $(ls *.go 2>/dev/null | LC_ALL=C sort)) | sha256sum | cut -c1-16
}

build() {  # name, package to build within the module[, module directory: default tests/peers/<name>]
    local name=$1 package=$2 dir=$here/${3:-$1}
    local out=$cache/$name-$(key "$dir")/$name
    if [ ! -x "$out" ]; then
        mkdir -p "$cache"
        local tmp
        tmp=$(mktemp -d "$cache/.build-$name-XXXXXX")
        echo "build_stack.sh: building $name (several minutes on 2 cores) ..." >&2
        (cd "$dir" && nice -n 10 go build -trimpath -o "$tmp/$name" "$package")
        mkdir -p "$(dirname "$out")"
        mv "$tmp/$name" "$out"  # atomic: a half-built binary is never at $out
        rmdir "$tmp"
    fi
    echo "$out"
}

for name in "${@:-otelcol jaeger helm}"; do
    for n in $name; do
        case $n in
            otelcol) build otelcol . ;;
            jaeger) build jaeger github.com/jaegertracing/jaeger/cmd/jaeger ;;
            helm) build helm helm.sh/helm/v4/cmd/helm ;;
            kube-apiserver) build kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver ;;
            etcd) build etcd go.etcd.io/etcd/server/v3 kube-apiserver ;;
            *) echo "build_stack.sh: unknown peer $n (otelcol, jaeger, helm, kube-apiserver, etcd)" >&2; exit 2 ;;
        esac
    done
done
