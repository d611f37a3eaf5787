"""Verifier of summarize-sales-csv (root, ``python3 -I``, in the workdir): reads ``summary.json`` as
untrusted data (a regular file of at most 64 KiB, strict JSON: ``grading.read_file``,
``grading.parse_json``) and writes reward.json with three parts, each 0 or 1 (the reward is their mean,
so partial work earns partial credit): ``valid_json`` (a JSON object), ``regions`` (exactly the regions
of sales.csv as shipped) and ``totals`` (each a finite number, not a bool, equal to its region's sum).

Usage: python3 -I grade.py VERIFIER_DIR
"""

from __future__ import annotations

import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves this directory off sys.path

import grading

#: The sums of sales.csv as shipped (editing the CSV changes nothing).
WANT = {"north": 12.5, "south": 7.0, "east": 9.0, "west": 0.5}


def grade() -> tuple[dict[str, float], list[str]]:
    parts = {"valid_json": 0.0, "regions": 0.0, "totals": 0.0}
    try:
        got = grading.parse_json(grading.read_file("summary.json", 64 * 1024))
    except grading.Refused as exc:
        return parts, [str(exc)]
    except ValueError as exc:
        return parts, [f"summary.json is not strict JSON ({grading.short(str(exc), 200)})"]
    if type(got) is not dict:
        return parts, [f"summary.json holds {grading.short(got)}, not a JSON object"]
    parts["valid_json"] = 1.0
    if set(got) != set(WANT):
        return parts, [f"summary.json has the regions {grading.short(sorted(got))}, want {sorted(WANT)}"]
    parts["regions"] = 1.0
    wrong = [f"{region}: {grading.short(got[region])}, want {want}" for region, want in WANT.items()
             if (x := grading.number(got[region])) is None
             or not math.isclose(x, want, rel_tol=0, abs_tol=1e-9)]
    if not wrong:
        parts["totals"] = 1.0
    return parts, wrong


def main() -> None:
    parts, notes = grade()
    for line in notes[:12]:
        print(line)
    print(f"summary.json: {parts}")
    grading.write_reward(sys.argv[1], "reward.json", json.dumps(parts) + "\n")


if __name__ == "__main__":
    main()
