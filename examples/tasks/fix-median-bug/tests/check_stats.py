"""Exit 0 when stats.py (in the current directory) computes medians and means correctly."""

import os
import sys

sys.path.insert(0, os.getcwd())
try:
    import stats
except Exception as exc:  # a syntax error is a failed task, not a crashed verifier
    print(f"cannot import stats.py: {exc}")
    sys.exit(1)

CASES = [([3, 1, 2], 2), ([4, 1, 3, 2], 2.5), ([7], 7), ([2, 2], 2), ([10, -10, 0, 5, 5, 1], 3.0)]
ok = True
for values, want in CASES:
    try:
        got = stats.median(list(values))
    except Exception as exc:
        print(f"median({values}) raised {exc!r}")
        ok = False
        continue
    if got != want:
        print(f"median({values}) = {got!r}, want {want!r}")
        ok = False
if stats.mean([1, 2, 3, 4]) != 2.5:
    print("mean is broken")
    ok = False
sys.exit(0 if ok else 1)
