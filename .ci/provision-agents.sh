#!/usr/bin/env bash
# Provision what the harness tests need (idempotent; seconds when already done):
#   1. Debian's tmux, patchelf and strace; Node.js/npm are on the machine image (else Debian's nodejs, npm);
#   2. a relocatable Python 3.12 at /opt/ares-agents/python/3.12 (copied from pyenv, RUNPATH made
#      relative) for Terminus-2, whose harbor package needs Python >= 3.12;
#   3. every harness CLI at its pinned version under /opt/ares-agents (python3 -m harnesses.provision);
#   4. the agents image ares-gateway/agents:latest (docker/agents/Dockerfile), rebuilt only when the
#      tree or the recipe changed. In glob order this script runs BEFORE provision-docker.sh, so it
#      runs that one first (idempotent, about a second when done) for the engine and the base image.
set -euo pipefail
cd "$(dirname "$0")/.."
root="${ARES_AGENTS_ROOT:-/opt/ares-agents}"

bash .ci/provision-docker.sh

# harnesses.provision imports this repository's packages; .ci/run installs them only after provisioning.
python3 -c 'import sandbox, harnesses' 2>/dev/null || python3 -m pip install -q -e '.[test]'

need=()
command -v tmux >/dev/null 2>&1 || need+=(tmux)
command -v patchelf >/dev/null 2>&1 || need+=(patchelf)
command -v strace >/dev/null 2>&1 || need+=(strace)  # the "agents contact only the gateway" test
command -v node >/dev/null 2>&1 || need+=(nodejs)
command -v npm >/dev/null 2>&1 || need+=(npm)
python3 -c 'import venv, ensurepip' 2>/dev/null && /usr/bin/python3 -c 'import ensurepip' 2>/dev/null || need+=(python3-venv)
if [ "${#need[@]}" -gt 0 ]; then
    echo "installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

py="$root/python/3.12"
if ! "$py/bin/python3" -c 'import sys, ssl, venv; assert sys.version_info >= (3, 12)' 2>/dev/null; then
    src=""
    # A self-contained 3.12 prefix to copy: pyenv's or uv's (python-build-standalone); the last wins.
    for cand in /root/.local/share/uv/python/cpython-3.12.* "${PYENV_ROOT:-/root/.pyenv}"/versions/3.12.* \
                /root/.pyenv/versions/3.12.*; do
        [ -x "$cand/bin/python3" ] && [ -x "$cand/bin/python3.12" ] && src="$cand"
    done
    if [ -z "$src" ]; then
        echo "no Python 3.12 under pyenv's or uv's versions (~/.pyenv/versions/3.12.*, ~/.local/share/uv/python/cpython-3.12.*):" \
             "Terminus-2 needs one (its install also looks on PATH, in /usr/local/bin and /usr/bin);" \
             "run 'uv python install 3.12' or 'pyenv install 3.12' and rerun this script" >&2
    else
        echo "copying $src to $py"
        rm -rf "$py.tmp" && mkdir -p "$root/python" && cp -a "$src" "$py.tmp"
        for exe in "$py.tmp"/bin/python3.12; do patchelf --set-rpath '$ORIGIN/../lib' "$exe"; done
        rm -rf "$py" && mv "$py.tmp" "$py"
        "$py/bin/python3" -c 'import ssl, sqlite3, venv' >/dev/null
    fi
fi

python3 -m harnesses.provision --install-root "$root"

if docker info >/dev/null 2>&1; then
    tag="${ARES_AGENTS_IMAGE:-ares-gateway/agents:latest}"
    # The image's key: the recipe, the base image and the tree's harness versions (each .ares-complete).
    key="$( { sha256sum docker/agents/Dockerfile; docker image inspect -f '{{.Id}}' ares-gateway/agent-base:latest;
              find "$root" -maxdepth 3 -name .ares-complete | sort; ls -d "$py" 2>/dev/null; } | sha256sum | cut -c1-16)"
    current="$(docker image inspect -f '{{ index .Config.Labels "ares-gateway.recipe" }}' "$tag" 2>/dev/null || true)"
    if [ "$current" != "$key" ]; then
        echo "building $tag (copies $root)"
        start=$(date +%s)
        docker build -q --network host --label "ares-gateway.recipe=$key" -t "$tag" -f docker/agents/Dockerfile "$root"
        echo "built $tag in $(( $(date +%s) - start )) s"
    else
        echo "agents image $tag is up to date"
    fi
else
    echo "no Docker engine: skipping the agents image (the harness Docker tests need it)" >&2
fi
