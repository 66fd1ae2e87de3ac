#!/usr/bin/env bash
# Builds the kvmiss container image with podman.
#
#   deploy/container/build.sh            # on Debian bases made here with mmdebstrap (no registry)
#   deploy/container/build.sh --public   # on the Containerfile's default public Python images
#   deploy/container/build.sh --bases    # only make (or find) the two local bases and print them
#
# The local bases are Debian $KVMISS_DEBIAN_SUITE with the packages in base-runtime.packages and
# base-build.packages; each is made once and cached (a tarball in $KVMISS_IMAGE_CACHE and an
# image in podman's store) under a key over its package list, suite and mirrors, so it is remade
# only when one of those changes (--refresh-bases forces it, e.g. for a point release). The
# versions each base resolved are written beside its tarball (*.manifest).
#
# Environment: KVMISS_IMAGE (tag; default localhost/kvmiss:<version>), KVMISS_IMAGE_CACHE
# (default ~/.cache/kvmiss-image), KVMISS_DEBIAN_SUITE (bookworm), KVMISS_DEBIAN_MIRROR,
# KVMISS_DEBIAN_SECURITY_MIRROR (deb.debian.org), KVMISS_BUILD_ISOLATION (chroot).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
suite=${KVMISS_DEBIAN_SUITE:-bookworm}
mirror=${KVMISS_DEBIAN_MIRROR:-http://deb.debian.org/debian}
security_mirror=${KVMISS_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
cache=${KVMISS_IMAGE_CACHE:-$HOME/.cache/kvmiss-image}
version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$root/enricher/__init__.py" | head -n1)
image=${KVMISS_IMAGE:-localhost/kvmiss:$version}
# chroot: builds where the OCI runtime cannot create cgroups (nested VMs, CI sandboxes).
isolation=${KVMISS_BUILD_ISOLATION:-chroot}

mode=local refresh=0
for arg in "$@"; do
    case $arg in
        --public) mode=public ;;
        --bases) mode=bases ;;
        --refresh-bases) refresh=1 ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "build.sh: unknown argument $arg (see --help)" >&2; exit 2 ;;
    esac
done

for tool in podman $([ "$mode" = public ] || echo mmdebstrap); do
    command -v "$tool" >/dev/null || { echo "build.sh: $tool not found (apt-get install podman mmdebstrap)" >&2; exit 1; }
done

# One base: $1 is runtime or build. Prints the image name.
make_base() {
    local kind=$1 list="$here/base-$1.packages"
    local packages key name tar
    packages=$(grep -v '^\s*#' "$list" | grep -v '^\s*$' | sort | paste -sd, -)
    # v2: the mmdebstrap options below; bump it when they change.
    key=$(printf 'v2\n%s\n%s\n%s\n%s\n' "$suite" "$mirror" "$security_mirror" "$packages" | sha256sum | cut -c1-16)
    name="localhost/kvmiss-base:$kind-$key"
    tar="$cache/kvmiss-base-$kind-$key.tar"
    if [ "$refresh" = 1 ]; then
        rm -f "$tar"
        podman image rm -f "$name" >/dev/null 2>&1 || true
    fi
    if podman image exists "$name"; then
        echo "$name"
        return
    fi
    if [ ! -s "$tar" ]; then
        echo "build.sh: making the $kind base ($suite: $packages)" >&2
        # Fixed timestamps make the tarball depend on the package versions only. The merged-usr
        # hook lays out /usr itself, so usrmerge and the full Perl it needs stay out.
        SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-1767225600} mmdebstrap --variant=apt --format=tar \
            --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
            --include="$packages" \
            --dpkgopt='path-exclude=/usr/share/man/*' \
            --dpkgopt='path-exclude=/usr/share/doc/*' \
            --dpkgopt='path-include=/usr/share/doc/*/copyright' \
            --dpkgopt='path-exclude=/usr/share/locale/*' \
            --customize-hook="chroot \"\$1\" dpkg-query -W -f '\${Package}=\${Version}\n' > '$tar.manifest.tmp'" \
            "$suite" "$tar.tmp" \
            "deb $mirror $suite main" "deb $mirror $suite-updates main" \
            "deb $security_mirror $suite-security main" >&2
        mv "$tar.manifest.tmp" "$tar.manifest"
        mv "$tar.tmp" "$tar"
    fi
    podman import --quiet \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["/bin/bash"]' \
        "$tar" "$name" >/dev/null
    echo "$name"
}

build_args=()
if [ "$mode" != public ]; then
    mkdir -p "$cache"
    exec 9>"$cache/lock"
    flock 9  # two builds at once share one base instead of both making it
    runtime_base=$(make_base runtime)
    build_base=$(make_base build)
    if [ "$mode" = bases ]; then
        echo "PYTHON_IMAGE=$runtime_base"
        echo "BUILD_IMAGE=$build_base"
        exit 0
    fi
    build_args=(--build-arg "PYTHON_IMAGE=$runtime_base" --build-arg "BUILD_IMAGE=$build_base")
fi

# A host whose pip goes through a mirror or a TLS-inspecting proxy: the build's pip reads the
# same settings. Mounted only for RUN steps: nothing of them lands in the image.
mounts=()
for file in /etc/pip.conf /etc/ssl/certs/ca-certificates.crt; do
    [ -f "$file" ] && mounts+=(-v "$file:$file:ro")
done

podman build --isolation "$isolation" \
    "${build_args[@]}" "${mounts[@]}" \
    --label "org.opencontainers.image.version=$version" \
    -f "$here/Containerfile" --ignorefile "$here/Containerfile.dockerignore" \
    -t "$image" "$root" >&2
echo "$image"
