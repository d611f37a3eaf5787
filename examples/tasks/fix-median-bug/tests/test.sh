#!/bin/sh
# Verifier: checks stats.py in the current directory (the task's workdir) and writes reward.txt
# (1 or 0) to $ARES_VERIFIER_DIR (default /logs/verifier).
set -u
VERIFIER_DIR="${ARES_VERIFIER_DIR:-/logs/verifier}"
TESTS_DIR=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$VERIFIER_DIR"
if PYTHONDONTWRITEBYTECODE=1 python3 "$TESTS_DIR/check_stats.py"; then
    echo 1 > "$VERIFIER_DIR/reward.txt"
else
    echo 0 > "$VERIFIER_DIR/reward.txt"
fi
