#!/bin/sh
# Verifier: checks summary.json; writes reward.json {"valid_json", "regions", "totals"} (each 0 or 1;
# the reward is their mean, so partial work earns partial credit) to $ARES_VERIFIER_DIR
# (default /logs/verifier).
set -u
VERIFIER_DIR="${ARES_VERIFIER_DIR:-/logs/verifier}"
mkdir -p "$VERIFIER_DIR"
# -I: no module the agent left in the workdir (a json.py, a .pth) is imported by root here.
python3 -I - "$VERIFIER_DIR/reward.json" <<'PY'
import json
import math
import pathlib
import sys

want = {"north": 12.5, "south": 7.0, "east": 9.0, "west": 0.5}
parts = {"valid_json": 0.0, "regions": 0.0, "totals": 0.0}
try:
    got = json.loads(pathlib.Path("summary.json").read_text())
except (OSError, ValueError) as exc:
    print(f"summary.json is missing or not JSON: {exc}")
    got = None
if isinstance(got, dict):
    parts["valid_json"] = 1.0
    if set(got) == set(want):
        parts["regions"] = 1.0
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in got.values())
        if numbers and all(math.isclose(got[k], v, abs_tol=1e-9) for k, v in want.items()):
            parts["totals"] = 1.0
pathlib.Path(sys.argv[1]).write_text(json.dumps(parts) + "\n")
PY
