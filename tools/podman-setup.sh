#!/bin/bash
# Podman from Debian's packages, set up to build and run docker/ without Docker or Docker Hub.
#
#   tools/podman-setup.sh install             apt-get install podman, buildah, podman-compose, debootstrap...
#   tools/podman-setup.sh conf DIR            write DIR/containers.conf + DIR/storage.conf (storage in DIR)
#                                             and print the two `export` lines that select them
#   tools/podman-setup.sh base TAG [CACHE]    a Debian 12 base image with Python 3.11 made from the apt
#                                             mirror (debootstrap + podman import): no registry needed
#
# Then build with the base as BASE_IMAGE and --pull=never (see README, "Docker"):
#   podman build --pull=never --build-arg BASE_IMAGE=TAG -f docker/Dockerfile.cpu -t minidist:cpu .
#
# `conf` settings, for VMs like the course's CI machine (harmless elsewhere):
#   runtime runc             crun refuses a hybrid cgroup v1+v2 layout
#   cgroupfs, file events    no systemd session to talk to
#   default_ulimits          podman's defaults exceed the hard limits of many VMs ("setrlimit ... not permitted")
# tests/integration/test_docker_build.py uses all three commands; run as root.
set -euo pipefail

die() { echo "podman-setup: $*" >&2; exit 1; }
TMP=()                                   # temporary folders, removed however the script ends
trap 'rm -rf "${TMP[@]}"' EXIT

cmd_install() {
    local need=()
    for b in podman buildah podman-compose debootstrap runc; do command -v "$b" >/dev/null || need+=("$b"); done
    [ ${#need[@]} -eq 0 ] && return 0
    command -v apt-get >/dev/null || die "missing ${need[*]} and no apt-get to install them"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq -o DPkg::Lock::Timeout=300
    apt-get install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=300 \
        podman buildah podman-compose debootstrap runc netavark aardvark-dns iptables uidmap \
        >/dev/null
}

cmd_conf() {
    local dir=${1:?usage: podman-setup.sh conf DIR}
    mkdir -p "$dir/storage" "$dir/run" "$dir/networks"
    dir=$(cd "$dir" && pwd)
    cat > "$dir/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[network]
network_config_dir = "$dir/networks"

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "$dir/events.log"
EOF
    cat > "$dir/storage.conf" <<EOF
[storage]
driver = "overlay"
graphroot = "$dir/storage"
runroot = "$dir/run"
EOF
    echo "export CONTAINERS_CONF=$dir/containers.conf CONTAINERS_STORAGE_CONF=$dir/storage.conf"
}

# The Debian mirror apt already uses (deb822 .sources or sources.list), else deb.debian.org.
mirror() {
    local m
    m=$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '$2 !~ /security/ {print $2; exit}')
    [ -n "$m" ] || m=$(grep -hs '^deb ' /etc/apt/sources.list | awk '$2 !~ /security/ {print $2; exit}')
    echo "${m:-http://deb.debian.org/debian}"
}

cmd_base() {
    local tag=${1:?usage: podman-setup.sh base TAG [CACHE_DIR]}
    local cache=${2:-${XDG_CACHE_HOME:-$HOME/.cache}/minidist}
    local saved="$cache/base-bookworm.tar" keep=localhost/minidist-cache/base:bookworm
    mkdir -p "$cache"
    # The finished base is cached for a week (`podman save`: ~270 MB); a warm start is one
    # `podman load`. Every image build runs apt-get update again, so the week costs no updates.
    if [ -n "$(find "$saved" -mtime -7 2>/dev/null)" ] && podman load -q -i "$saved" >/dev/null 2>&1; then
        podman tag "$keep" "$tag" && podman untag "$keep" "$keep" && return 0
    fi
    local root ctx
    root=$(mktemp -d /var/tmp/minidist-rootfs.XXXXXX); TMP+=("$root")
    ctx=$(mktemp -d /tmp/minidist-base.XXXXXX); TMP+=("$ctx")
    debootstrap --variant=minbase bookworm "$root" "$(mirror)" >"$ctx/debootstrap.log" 2>&1 \
        || die "debootstrap failed: $(tail -5 "$ctx/debootstrap.log")"
    tar -C "$root" --exclude='./var/cache/apt/archives/*.deb' --exclude='./var/lib/apt/lists/*' -c . \
        | podman import -q - "$tag-rootfs" >/dev/null
    # what the python:3.11-slim image has that the Dockerfiles rely on: python, venv, CA bundle
    printf '%s\n' "FROM $tag-rootfs" \
        "RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \\" \
        "    python-is-python3 ca-certificates && rm -rf /var/lib/apt/lists/*" > "$ctx/Containerfile"
    podman build -q --pull=never --layers=false -t "$tag" "$ctx" >/dev/null
    podman rmi "$tag-rootfs" >/dev/null
    podman tag "$tag" "$keep" && podman save -q -o "$saved.tmp" "$keep" && mv "$saved.tmp" "$saved"
    podman untag "$keep" "$keep"   # the cache name only: $tag stays
}

case "${1:-}" in
    install) cmd_install ;;
    conf) shift; cmd_conf "$@" ;;
    base) shift; cmd_base "$@" ;;
    *) die "usage: $0 install | conf DIR | base TAG [CACHE_DIR]" ;;
esac
