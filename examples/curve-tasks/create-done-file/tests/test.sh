#!/bin/sh
# Verifier: done.txt must be a regular file in the working directory (read as
# untrusted data by grade.py: no symlink or FIFO followed, at most 4 KiB read); writes reward.txt
# (1 or 0) to $ARES_VERIFIER_DIR (default /logs/verifier).
# -I: the agent's files are data, never code (no workdir on sys.path: a pathlib.py there would run as root).
set -u
VERIFIER_DIR="${ARES_VERIFIER_DIR:-/logs/verifier}"
TESTS_DIR=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$VERIFIER_DIR"
exec python3 -I -B "$TESTS_DIR/grade.py" "$VERIFIER_DIR"
