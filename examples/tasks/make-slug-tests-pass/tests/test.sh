#!/bin/sh
# Verifier: runs the agent's slug.py in a process of its own (as uid 65534 when root) on the visible
# tests' cases (grade.py's own copy, so editing test_slug.py does not help), hidden cases and random
# titles, and writes reward.json {"visible_tests", "hidden_tests"} to $ARES_VERIFIER_DIR
# (default /logs/verifier). -I: nothing the agent left is imported here.
set -u
VERIFIER_DIR="${ARES_VERIFIER_DIR:-/logs/verifier}"
TESTS_DIR=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$VERIFIER_DIR"
exec python3 -I -B "$TESTS_DIR/grade.py" "$VERIFIER_DIR"
