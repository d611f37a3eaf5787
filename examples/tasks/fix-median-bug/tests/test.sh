#!/bin/sh
# Verifier: runs the agent's stats.py in a process of its own (as uid 65534 when root) on fixed and
# random lists, checks its answers against grade.py's reference, and writes reward.txt (1 or 0) to
# $ARES_VERIFIER_DIR (default /logs/verifier). -I: nothing the agent left is imported here.
set -u
VERIFIER_DIR="${ARES_VERIFIER_DIR:-/logs/verifier}"
TESTS_DIR=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$VERIFIER_DIR"
exec python3 -I -B "$TESTS_DIR/grade.py" "$VERIFIER_DIR"
