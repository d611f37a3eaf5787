#!/usr/bin/env bash
# Provision the trainer packages that install apart from their extras (docs/training.md): each extra's
# packages, then the package itself with --no-deps.
#
# - skyrl 0.3.0 (ares_gateway.trainers.skyrl): it pins transformers<=5.8.0 and peft==0.18.1; resolving
#   those would replace the versions the trl and verl extras are tested with, and the generator and
#   trainer modules the adapter and its test import need neither pin.
# - openenv 0.10.0 (ares_gateway.trainers.openenv, TRL's AsyncGRPO harness path): it requires gradio
#   (its web UI), which would downgrade pillow; the harness modules do not import it.
#
# Idempotent: nothing happens when both adapters import.
set -euo pipefail
cd "$(dirname "$0")/.."

present() { python3 -c "import ares_gateway.trainers.skyrl, ares_gateway.trainers.openenv" 2>/dev/null; }

if present; then
    echo "skyrl, openenv and their extras are installed: nothing to do"
    exit 0
fi
python3 -m pip install --quiet --disable-pip-version-check -e '.[skyrl,openenv]'
python3 -m pip install --quiet --disable-pip-version-check --no-deps 'skyrl==0.3.0' 'openenv==0.10.0'
python3 -c "import ares_gateway.trainers.skyrl, ares_gateway.trainers.openenv; print('skyrl and openenv: the adapters import')"
