#!/usr/bin/env bash
# Provision Harbor (pip `harbor`, Python >= 3.12) in a virtual environment of its own, for the test
# that validates `ares-gateway export --format atif` with Harbor's own pydantic models
# (tests/recording/test_atif.py). The project itself runs on the system python3; Harbor is never
# imported by it.
#
# The venv: $ARES_HARBOR_VENV, default ${XDG_CACHE_HOME:-~/.cache}/ares-gateway/harbor-venv. The
# interpreter: $ARES_PYTHON312, else python3.12 / python3.13 on PATH, else pyenv's newest 3.12 or 3.13.
# Idempotent: nothing happens when the venv's python imports harbor.models.trajectories.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${ARES_HARBOR_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ares-gateway/harbor-venv}"
if "$venv/bin/python" -c "import harbor.models.trajectories" 2>/dev/null; then
    echo "harbor is installed in $venv: nothing to do"
    exit 0
fi

usable() { "$1" -c 'import sys; assert sys.version_info >= (3, 12)' >/dev/null 2>&1; }

find_python() {  # the first candidate that runs and is >= 3.12 (a pyenv shim may name one it cannot run)
    local candidates=()
    [ -n "${ARES_PYTHON312:-}" ] && candidates+=("$ARES_PYTHON312")
    candidates+=(python3.12 python3.13)
    if command -v pyenv >/dev/null 2>&1; then
        local root; root=$(pyenv root)
        for v in $(ls "$root/versions" 2>/dev/null | grep -E '^3\.1[23]\.[0-9]+$' | sort -V -r); do
            candidates+=("$root/versions/$v/bin/python3")
        done
    fi
    for c in "${candidates[@]}"; do
        if usable "$c"; then echo "$c"; return; fi
    done
}

python=$(find_python)
if [ -z "$python" ]; then
    echo "no Python 3.12 or 3.13 found (Harbor needs >= 3.12): install one, or set ARES_PYTHON312" >&2
    exit 1
fi
mkdir -p "$(dirname "$venv")"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check harbor
"$venv/bin/python" -c "import harbor.models.trajectories, importlib.metadata as m; print('harbor', m.version('harbor'), 'in $venv')"
