#!/bin/sh
# Verifier: checks summary.json (read as untrusted data by grade.py: a regular file, bounded, strict
# JSON); writes reward.json {"valid_json", "regions", "totals"} (each 0 or 1; the reward is their
# mean, so partial work earns partial credit) to $ARES_VERIFIER_DIR (default /logs/verifier).
# -I: no module the agent left in the workdir (a json.py, a .pth) is imported by root here.
set -u
VERIFIER_DIR="${ARES_VERIFIER_DIR:-/logs/verifier}"
TESTS_DIR=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$VERIFIER_DIR"
exec python3 -I -B "$TESTS_DIR/grade.py" "$VERIFIER_DIR"
