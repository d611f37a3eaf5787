#!/usr/bin/env bash
# Provision a real Docker engine for the sandbox tests (idempotent; quick when already done):
#   1. Debian's docker.io, debootstrap, bubblewrap, libseccomp2, e2fsprogs and mount (sandbox limits);
#   2. dockerd with no bridge and no iptables (containers use host networking), if none answers;
#   3. the registry-free Debian base image (docker/build-base-image.sh) and the agent base image.
# .ci/run exports ARES_CI=1, which makes Docker-dependent tests fail instead of skip.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
command -v bwrap >/dev/null 2>&1 || need+=(bubblewrap)
# The hardened local sandbox: libseccomp (its filter); mkfs.ext4 and losetup (the disk limit of local
# sandboxes and of Docker's writable layer, a loop-mounted ext4).
ldconfig -p | grep 'libseccomp\.so\.2' >/dev/null || need+=(libseccomp2)
command -v mkfs.ext4 >/dev/null 2>&1 || need+=(e2fsprogs)
command -v losetup >/dev/null 2>&1 || need+=(mount)
if [ "${#need[@]}" -gt 0 ]; then
    echo "installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

if ! docker info >/dev/null 2>&1; then
    echo "starting dockerd (--bridge=none --iptables=false)"
    log=/var/log/ares-dockerd.log
    # A stale pid file from a killed daemon would stop a new one from starting.
    if [ -f /var/run/docker.pid ] && ! kill -0 "$(cat /var/run/docker.pid)" 2>/dev/null; then
        rm -f /var/run/docker.pid
    fi
    setsid nohup dockerd --bridge=none --iptables=false --ip6tables=false >"$log" 2>&1 < /dev/null &
    for _ in $(seq 1 60); do
        docker info >/dev/null 2>&1 && break
        sleep 1
    done
    if ! docker info >/dev/null 2>&1; then
        echo "dockerd did not come up; last lines of $log:" >&2
        tail -n 30 "$log" >&2
        exit 1
    fi
fi
echo "docker engine: $(docker version --format '{{.Server.Version}}')"

bash docker/build-base-image.sh

# The agent base image, rebuilt only when its recipe changes.
agent_tag="${ARES_AGENT_IMAGE:-ares-gateway/agent-base:latest}"
recipe_hash="$(sha256sum docker/agent/Dockerfile | cut -c1-16)"
current="$(docker image inspect -f '{{ index .Config.Labels "ares-gateway.recipe" }}' "$agent_tag" 2>/dev/null || true)"
if [ "$current" != "$recipe_hash" ]; then
    echo "building $agent_tag"
    docker build -q --network host --label "ares-gateway.recipe=$recipe_hash" -t "$agent_tag" docker/agent
else
    echo "agent image $agent_tag is up to date"
fi
