"""Verifier of write-greeting-file (root, ``python3 -I``, in the workdir): reward.txt 1 when
``greeting.txt`` is a regular file (not a symlink, FIFO or device: ``grading.read_file``) holding
exactly ``Hello from ARES!\\n``; else 0.

Usage: python3 -I grade.py VERIFIER_DIR
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves this directory off sys.path

import grading

WANT = b"Hello from ARES!\n"


def main() -> None:
    try:
        got = grading.read_file("greeting.txt", 4096)
    except grading.Refused as exc:
        ok, note = False, str(exc)
    else:
        ok = got == WANT
        note = ("greeting.txt is right" if ok
                else f"greeting.txt holds {grading.short(got[:200])}, want {WANT!r}")
    print(f"{note} -> reward {int(ok)}")
    grading.write_reward(sys.argv[1], "reward.txt", "1\n" if ok else "0\n")


if __name__ == "__main__":
    main()
