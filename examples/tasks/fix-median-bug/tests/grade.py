"""Verifier of fix-median-bug (root, ``python3 -I``, in the workdir): reward.txt 1 when the agent's
``stats.py``, run in a process of its own (``grading.run_untrusted``), computes ``median`` and ``mean``
of fixed lists and of random lists drawn for this run as this file's reference does; else 0.

Usage: python3 -I grade.py VERIFIER_DIR
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves this directory off sys.path

import grading

FIXED_MEDIAN: list[list[float]] = [[3, 1, 2], [4, 1, 3, 2], [7], [2, 2], [10, -10, 0, 5, 5, 1], [1.5, 0.5],
                                   [5, 3, 1, 4, 2, 6]]
FIXED_MEAN: list[list[float]] = [[1, 2, 3, 4], [5], [-1, 1, 3.5]]

# Runs in the agent's process: calls the functions, prints one JSON object of what they returned.
# Only this file's own descriptor reaches stdout; whatever the agent's code prints goes to stderr.
RUNNER = r'''
import json, os, sys
out = os.fdopen(os.dup(1), "w", encoding="utf-8")
os.dup2(2, 1)
sys.path.insert(0, os.getcwd())
with open("cases.json", encoding="utf-8") as fh:
    cases = json.load(fh)

def call(fn, values):
    try:
        got = fn(list(values))
    except BaseException as exc:
        return {"raised": type(exc).__name__}
    return got if type(got) in (int, float) else {"returned": type(got).__name__}

try:
    import stats
    result = {"median": [call(stats.median, c) for c in cases["median"]],
              "mean": [call(stats.mean, c) for c in cases["mean"]]}
except BaseException as exc:
    result = {"import_error": (type(exc).__name__ + ": " + str(exc))[:300]}
out.write(json.dumps(result))
out.flush()
'''


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def random_lists(rng: random.SystemRandom, count: int) -> list[list[float]]:
    lists: list[list[float]] = []
    for i in range(count):
        n = rng.randint(1, 15) if i >= 2 else rng.choice([2, 4, 6, 8, 10])  # always some even lengths
        if rng.random() < 0.3:
            lists.append([round(rng.uniform(-500, 500), 2) for _ in range(n)])
        else:
            lists.append([rng.randint(-1000, 1000) for _ in range(n)])
    return lists


def check(name: str, got: list[object], cases: list[list[float]],
          reference: Callable[[list[float]], float]) -> list[str]:
    wrong = []
    for values, value in zip(cases, got, strict=True):
        want = reference(values)
        x = grading.number(value)
        if x is None or not math.isclose(x, want, rel_tol=1e-9, abs_tol=1e-9):
            wrong.append(f"{name}({grading.short(values, 80)}) = {grading.short(value)}, want {want!r}")
    return wrong


def grade() -> tuple[bool, list[str]]:
    rng = random.SystemRandom()
    cases: dict[str, list[list[float]]] = {"median": FIXED_MEDIAN + random_lists(rng, 24),
                                           "mean": FIXED_MEAN + random_lists(rng, 6)}
    try:
        source = grading.read_file("stats.py", 256 * 1024)
    except grading.Refused as exc:
        return False, [str(exc)]
    run = grading.run_untrusted({"stats.py": source, "grade_runner.py": RUNNER.encode(),
                                 "cases.json": json.dumps(cases).encode()}, "grade_runner.py")
    notes = [run.isolation]
    if run.stderr_tail.strip():
        notes.append("its stderr (end): " + grading.short(run.stderr_tail[-600:], 700))
    if run.stdout is None:
        return False, [*notes, f"stats.py failed: {run.error}"]
    try:
        result = grading.parse_json(run.stdout)
    except ValueError as exc:
        return False, [*notes, f"the run printed no valid JSON ({exc})"]
    if type(result) is not dict:
        return False, [*notes, f"the run printed {grading.short(result)}, not a JSON object"]
    if "import_error" in result:
        return False, [*notes, f"cannot import stats.py: {grading.short(result['import_error'], 300)}"]
    wrong = []
    references: dict[str, Callable[[list[float]], float]] = {"median": median, "mean": mean}
    for name, reference in references.items():
        got = result.get(name)
        if type(got) is not list or len(got) != len(cases[name]):
            wrong.append(f"the run gave no list of {len(cases[name])} results for {name}")
        else:
            wrong += check(name, got, cases[name], reference)
    return not wrong, notes + wrong


def main() -> None:
    ok, notes = grade()
    for line in notes[:12]:
        print(line)
    print(f"stats.py: {'all cases right' if ok else 'wrong'} -> reward {int(ok)}")
    grading.write_reward(sys.argv[1], "reward.txt", "1\n" if ok else "0\n")


if __name__ == "__main__":
    main()
