"""Verifier of make-slug-tests-pass (root, ``python3 -I``, in the workdir): runs the agent's ``slug.py``
in a process of its own (``grading.run_untrusted``) and writes reward.json with two parts:

* ``visible_tests``: 1 when ``slugify`` gives what the workspace's ``test_slug.py`` expects, on this
  file's own copy of those cases (editing ``test_slug.py`` changes nothing);
* ``hidden_tests``: 1 when it also gives what this file's reference gives on cases the agent never saw
  and on random titles drawn for this run (hard-coding the visible answers scores 0 here).

Usage: python3 -I grade.py VERIFIER_DIR
"""

from __future__ import annotations

import json
import os
import random
import re
import string
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves this directory off sys.path

import grading

#: The cases of the workspace's test_slug.py, as shipped.
VISIBLE = [("Hello World", "hello-world"), ("Hello, World!", "hello-world"),
           ("  many   spaces here ", "many-spaces-here"), ("Python 3 rocks", "python-3-rocks")]
HIDDEN = [("snake_case and-kebab", "snake-case-and-kebab"), ("!!!", ""),
          ("ARES Gateway v2", "ares-gateway-v2"), ("", ""),
          ("--Leading and trailing--", "leading-and-trailing"), ("a.b/c:d", "a-b-c-d")]
# What separates words in random titles: punctuation whose meaning is "a break", never one a slugifier
# might spell out or drop inside a word (& + ' are left out).
SEPARATORS = [" ", "  ", ", ", ". ", "! ", "? ", "-", "_", ": ", "; ", "/", " (", ") ", "\t", " -- "]

# Runs in the agent's process: calls slugify, prints one JSON object of what it returned.
# Only this file's own descriptor reaches stdout; whatever the agent's code prints goes to stderr.
RUNNER = r'''
import json, os, sys
out = os.fdopen(os.dup(1), "w", encoding="utf-8")
os.dup2(2, 1)
sys.path.insert(0, os.getcwd())
with open("cases.json", encoding="utf-8") as fh:
    cases = json.load(fh)

def call(fn, text):
    try:
        got = fn(text)
    except BaseException as exc:
        return {"raised": type(exc).__name__}
    return str.__str__(got) if isinstance(got, str) else {"returned": type(got).__name__}

try:
    import slug
    result = {"slugs": [call(slug.slugify, text) for text in cases]}
except BaseException as exc:
    result = {"import_error": (type(exc).__name__ + ": " + str(exc))[:300]}
out.write(json.dumps(result))
out.flush()
'''


def slugify(text: str) -> str:
    return "-".join(re.findall(r"[a-z0-9]+", text.lower()))


def random_titles(rng: random.SystemRandom, count: int) -> list[str]:
    alphabet = string.ascii_letters + string.digits
    titles = []
    for _ in range(count):
        words = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8)))
                 for _ in range(rng.randint(1, 6))]
        text = rng.choice(["", " ", "-", "(", "!! "])
        for i, word in enumerate(words):
            text += word + (rng.choice(SEPARATORS) if i < len(words) - 1 else "")
        titles.append(text + rng.choice(["", " ", "!", "?", ".", "--", " )"]))
    return titles


def grade() -> tuple[dict[str, float], list[str]]:
    rng = random.SystemRandom()
    visible = VISIBLE
    hidden = HIDDEN + [(t, slugify(t)) for t in random_titles(rng, 30)]
    parts = {"visible_tests": 0.0, "hidden_tests": 0.0}
    try:
        source = grading.read_file("slug.py", 256 * 1024)
    except grading.Refused as exc:
        return parts, [str(exc)]
    texts = [text for text, _ in visible + hidden]
    run = grading.run_untrusted({"slug.py": source, "grade_runner.py": RUNNER.encode(),
                                 "cases.json": json.dumps(texts).encode()}, "grade_runner.py")
    notes = [run.isolation]
    if run.stderr_tail.strip():
        notes.append("its stderr (end): " + grading.short(run.stderr_tail[-600:], 700))
    if run.stdout is None:
        return parts, [*notes, f"slug.py failed: {run.error}"]
    try:
        result = grading.parse_json(run.stdout)
    except ValueError as exc:
        return parts, [*notes, f"the run printed no valid JSON ({exc})"]
    if type(result) is not dict:
        return parts, [*notes, f"the run printed {grading.short(result)}, not a JSON object"]
    if "import_error" in result:
        return parts, [*notes, f"cannot import slug.py: {grading.short(result['import_error'], 300)}"]
    got = result.get("slugs")
    if type(got) is not list or len(got) != len(texts):
        return parts, [*notes, f"the run gave no list of {len(texts)} slugs"]
    wrong = []
    for part, cases, answers in (("visible_tests", visible, got[:len(visible)]),
                                 ("hidden_tests", hidden, got[len(visible):])):
        bad = [f"slugify({text!r}) = {grading.short(value)}, want {want!r}"
               for (text, want),
               value in zip(cases, answers, strict=True) if type(value) is not str or value != want]
        parts[part] = 0.0 if bad else 1.0
        wrong += [f"{part}: {line}" for line in bad]
    return parts, notes + wrong


def main() -> None:
    parts, notes = grade()
    for line in notes[:12]:
        print(line)
    print(f"slug.py: {parts}")
    grading.write_reward(sys.argv[1], "reward.json", json.dumps(parts) + "\n")


if __name__ == "__main__":
    main()
