#!/bin/sh
# Verifier: greeting.txt must hold exactly "Hello from ARES!\n"; writes reward.txt (1 or 0) to
# $ARES_VERIFIER_DIR (default /logs/verifier).
set -u
VERIFIER_DIR="${ARES_VERIFIER_DIR:-/logs/verifier}"
mkdir -p "$VERIFIER_DIR"
# -I: the agent's files are data, never code (no workdir on sys.path: a pathlib.py there would run as root).
python3 -I - "$VERIFIER_DIR/reward.txt" <<'PY'
import pathlib
import sys

path = pathlib.Path("greeting.txt")
ok = path.is_file() and path.read_bytes() == b"Hello from ARES!\n"
if not ok:
    print("greeting.txt is missing or has the wrong content:", path.read_bytes()[:200] if path.is_file() else None)
pathlib.Path(sys.argv[1]).write_text("1\n" if ok else "0\n")
PY
