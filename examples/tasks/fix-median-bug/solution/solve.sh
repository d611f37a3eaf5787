#!/bin/sh
# Reference solution: average the two middle elements (mid - 1 and mid), not mid and mid + 1.
set -eu
python3 - <<'PY'
import pathlib

path = pathlib.Path("stats.py")
source = path.read_text()
fixed = source.replace("(ordered[mid] + ordered[mid + 1]) / 2", "(ordered[mid - 1] + ordered[mid]) / 2")
assert fixed != source, "the buggy line was not found"
path.write_text(fixed)
PY
