"""Verifier of create-done-file (root, ``python3 -I``, in the workdir): reward.txt 1 when ``done.txt``
is a regular file (not a symlink, FIFO or device: ``grading.read_file``), whatever it holds; else 0.

Usage: python3 -I grade.py VERIFIER_DIR
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves this directory off sys.path

import grading


def main() -> None:
    try:
        grading.read_file("done.txt", 4096)
    except grading.Refused as exc:
        ok, note = False, str(exc)
    else:
        ok, note = True, "done.txt is a regular file"
    print(f"{note} -> reward {int(ok)}")
    grading.write_reward(sys.argv[1], "reward.txt", "1\n" if ok else "0\n")


if __name__ == "__main__":
    main()
