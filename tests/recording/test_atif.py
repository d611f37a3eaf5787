"""``ares-gateway export --format atif``: real runs of every harness (oracle, local sandboxes) and one with
token records (tito on the local model) exported, then validated with Harbor's own pydantic models in
a Python >= 3.12 venv (``bash .ci/provision-atif.sh``; a missing one skips, and fails in CI)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ares_gateway.episodes.atif import ATIF_SCHEMA_VERSION, episode_trajectory, export_atif, import_atif
from harnesses import registry
from harnesses.base import INSTALL_ROOT
from tests.helpers import cli
from tests.prereq import require
from tests.tito.conftest import need_llama

REPO = Path(__file__).resolve().parents[2]
PROVISION = "bash .ci/provision-atif.sh"
HARNESSES = {"tiny": "tiny-agent", "mswea": "mini-swe-agent", "cc": "claude-code", "codex": "codex",
             "terminus": "terminus-2"}

# Harbor's models, plus what they leave to the reader: every subagent ref resolves to an embedded
# trajectory and every embedded one is referenced; Harbor's own dump validates again.
VALIDATE = r"""
import json, sys
from harbor.models.trajectories import Trajectory
out = {}
for path in sys.argv[1:]:
    t = Trajectory.model_validate(json.load(open(path)))
    ids = {s.trajectory_id for s in t.subagent_trajectories or []}
    refs = [r.trajectory_id for s in t.steps if s.observation for res in s.observation.results
            for r in res.subagent_trajectory_ref or []]
    assert sorted(refs) == sorted(ids), (path, refs, ids)
    again = Trajectory.model_validate(t.to_json_dict())
    assert len(again.steps) == len(t.steps)
    out[path] = {"schema_version": t.schema_version, "steps": len(t.steps), "subagents": len(ids)}
print(json.dumps(out))
"""


def harbor_python() -> str:
    venv = Path(os.environ.get("ARES_HARBOR_VENV")
                or Path(os.environ.get("XDG_CACHE_HOME")
                        or Path.home() / ".cache") / "ares-gateway" / "harbor-venv")
    py = venv / "bin" / "python"
    ok = py.is_file() and subprocess.run([str(py), "-c", "import harbor.models.trajectories"],
                                         capture_output=True, check=False).returncode == 0
    require(ok, f"Harbor (pip harbor, Python >= 3.12) is not installed in {venv}: run {PROVISION}")
    return str(py)


def validate(paths: list[Path]) -> dict[str, Any]:
    proc = subprocess.run([harbor_python(), "-c", VALIDATE, *map(str, paths)], capture_output=True, text=True,
                          check=False, timeout=120)
    assert proc.returncode == 0, f"Harbor rejected an export:\n{proc.stderr[-4000:]}"
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One oracle episode of each harness and one tito episode (token records), run side by side."""
    harbor_python()
    for name in HARNESSES.values():
        version = registry.create(name).version
        prefix = f"{INSTALL_ROOT}/{name}/{version}"
        require(os.path.isfile(f"{prefix}/.ares-complete"),
                f"{name} {version} is not provisioned at {prefix}: run bash .ci/provision-agents.sh")
    need_llama()
    root = tmp_path_factory.mktemp("atif-runs")
    commands = {alias: ["examples-" + alias + ":0", "--policy", "oracle"] for alias in HARNESSES}
    commands["tito"] = ["examples-tiny:0", "--policy", "tito", "--step-limit", "1"]
    procs = {key: subprocess.Popen(
        cli("run", *args, "--sandbox", "local", "--out", str(root / key), "--stats", "null",
            "-n", "1"), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for key, args in commands.items()}
    for key, proc in procs.items():
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, f"run {key} failed:\n{out[-3000:]}"
    return {key: root / key for key in commands}


@pytest.mark.slow
def test_every_harness_exports_valid_atif(runs: dict[str, Path], tmp_path: Path) -> None:
    files: list[Path] = []
    for key, run in runs.items():
        if key == "tito":  # the command line once; the Python function for the others (no start-up each)
            proc = subprocess.run(cli("export", "--format", "atif", str(run), "--out", str(tmp_path / key)),
                                  cwd=REPO, capture_output=True, text=True, check=False)
            assert proc.returncode == 0, proc.stderr
            assert "wrote 1 ATIF trajectory file(s)" in proc.stdout
        else:
            report = export_atif(run, tmp_path / key)
            assert report.ok, report.problems
            assert report.written == [tmp_path / key / "fix-median-bug.0.json"]
        files += sorted((tmp_path / key).glob("*.json"))
    assert len(files) == len(runs)
    checked = validate(files)
    assert {v["schema_version"] for v in checked.values()} == {ATIF_SCHEMA_VERSION}

    for key in HARNESSES:
        doc = json.loads((tmp_path / key / "fix-median-bug.0.json").read_text())
        row = json.loads((runs[key] / "episodes.jsonl").read_text().splitlines()[0])
        turns = (runs[key] / "turns" / "fix-median-bug.0.jsonl").read_text().splitlines()
        assert doc["agent"]["name"] == HARNESSES[key]
        assert doc["agent"]["version"] == registry.create(HARNESSES[key]).version
        assert doc["extra"]["reward"] == row["reward"] == 1.0
        assert doc["extra"]["exit_reason"] == row["exit_reason"] == "completed"
        assert doc["session_id"] == row["session_id"]
        agent = [s for s in doc["steps"] if s["source"] == "agent" and s.get("llm_call_count") == 1]
        assert len(agent) == len(turns), key  # one agent step per answered turn
        assert any(s["source"] == "user" for s in doc["steps"]), key
        # The oracle's solution command is the first answer; its output is an observation (tool-calling
        # harnesses) or the next user message (terminus-2 reads the terminal as text).
        first = agent[0]
        if key == "terminus":
            assert "solve.sh" in first["message"]
            assert "[oracle] solution/solve.sh exited with status 0" in json.dumps(
                doc["steps"][doc["steps"].index(first) + 1:])
        else:
            call = first["tool_calls"][0]
            assert "solve.sh" in json.dumps(call["arguments"])
            results = first["observation"]["results"]
            assert results[0]["source_call_id"] == call["tool_call_id"]
            assert "exited with status 0" in json.dumps(results)

    # Token records: ids, logprobs and counts per step, equal to the turn log's.
    doc = json.loads((tmp_path / "tito" / "fix-median-bug.0.json").read_text())
    entries = [json.loads(line)
               for line in (runs["tito"] / "turns" / "fix-median-bug.0.jsonl").read_text().splitlines()]
    agent = [s for s in doc["steps"] if s["source"] == "agent"]
    assert len(agent) == len(entries) >= 1
    for step, entry in zip(agent, entries, strict=True):
        tokens = entry["completion"]["tokens"]
        m = step["metrics"]
        assert m["prompt_token_ids"] == tokens["prompt_ids"] and m["prompt_tokens"] == len(
            tokens["prompt_ids"])
        assert m["completion_token_ids"] == tokens["output_ids"]
        assert m["completion_tokens"] == len(tokens["output_ids"]) > 0
        assert m["logprobs"] == pytest.approx(tokens["output_logprobs"])
    assert doc["final_metrics"]["total_completion_tokens"] == sum(len(e["completion"]["tokens"]["output_ids"])
                                                                  for e in entries)

    # Without the ids: the counts stay, the ids and logprobs go.
    report = export_atif(runs["tito"], tmp_path / "no-ids", token_ids=False)
    lean = json.loads(report.written[0].read_text())
    m = next(s for s in lean["steps"] if s["source"] == "agent")["metrics"]
    m.pop("extra", None)  # the turn log's timing, where the run recorded it
    assert m == {"prompt_tokens": len(entries[0]["completion"]["tokens"]["prompt_ids"]),
                 "completion_tokens": len(entries[0]["completion"]["tokens"]["output_ids"])}


def _chat(messages: list[dict[str, Any]], completion: dict[str, Any], *, side: bool = False,
          n: int = 0) -> dict[str, Any]:
    return {"request_id": f"req_{n}", "protocol": "openai.chat", "side_call": side, "timestamp": 1.0e9 + n,
            "latency": 0.01, "request": {"model": "m", "messages": messages}, "completion": completion}


def test_side_calls_and_branches_are_linked_subagents(tmp_path: Path) -> None:
    """A side call and a main line that restarts from an earlier point (a compaction) become embedded
    subagent trajectories, each linked from the root; the branch marks what it repeats as copied."""
    sys_m = {"role": "system", "content": "be brief"}
    ask = {"role": "user", "content": "list files"}
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function",
                            "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]}
    result = {"role": "tool", "tool_call_id": "c1", "content": "a.py"}
    c_call = {"tool_calls": [{"id": "c1", "name": "bash", "arguments": '{"command": "ls"}'}],
              "finish_reason": "tool_calls"}
    entries = [
        _chat([sys_m, ask], c_call, n=1),
        _chat([{"role": "user", "content": "title this: list files"}], {"text": "Listing"}, side=True, n=2),
        dict(_chat([sys_m, ask, call, result], {"text": "a.py is there", "reasoning": "saw it"}, n=3),
             usage={"prompt_tokens": 12, "completion_tokens": 4, "parked_seconds": 0.5,
                    "ttft_seconds": None}),
        # Restarted from the first message with a summary in place of the history.
        _chat([sys_m, {"role": "user", "content": "summary: a.py exists. now count lines"}],
              {"text": "1 line", "usage": {"input_tokens": 30, "output_tokens": 2}}, n=4),
    ]
    doc = episode_trajectory({"task": "t", "attempt": 0, "reward": 0.5, "exit_reason": "completed",
                              "session_id": "s1", "harness": "tiny-agent"}, entries)
    assert doc is not None
    path = tmp_path / "t.0.json"
    path.write_text(json.dumps(doc))
    assert validate([path])[str(path)]["subagents"] == 2

    steps = doc["steps"]
    assert [s["source"] for s in steps] == ["system", "user", "agent", "agent"]
    assert steps[2]["observation"]["results"][0] == {"content": "a.py", "source_call_id": "c1"}
    assert steps[3]["reasoning_content"] == "saw it"
    assert steps[3]["metrics"] == {"prompt_tokens": 12, "completion_tokens": 4,
                                   "extra": {"parked_seconds": 0.5}}
    subs = {s["trajectory_id"]: s for s in doc["subagent_trajectories"]}
    assert set(subs) == {"t.0/side-1", "t.0/branch-1"}
    assert subs["t.0/side-1"]["steps"][-1]["message"] == "Listing"
    branch = subs["t.0/branch-1"]["steps"]
    assert branch[0]["is_copied_context"] is True and "is_copied_context" not in branch[1]
    assert branch[-1]["metrics"] == {"prompt_tokens": 30, "completion_tokens": 2, "cached_tokens": 0}
    # The side call came after turn 1, the branch after turn 3: each linked from the step before it.
    refs = {r["trajectory_id"]: i for i,
            s in enumerate(steps) for res in s.get("observation", {}).get("results", [])
            for r in res.get("subagent_trajectory_ref", [])}
    assert refs == {"t.0/side-1": 2, "t.0/branch-1": 3}
    assert doc["extra"]["reward"] == 0.5


def test_a_real_gateways_fork_and_side_call_with_token_records(tmp_path: Path) -> None:
    """A run written by a real gateway and the run's writer (the viewer's fixture: the OpenAI SDK as the
    agent, token records on every turn): a retry that forks after the first answer and a side call."""
    import asyncio

    from bench.support.viewer_runs import build_run, forked_session

    harbor_python()
    run = asyncio.run(build_run(tmp_path / "run", [("forked", 1.0, forked_session)]))
    report = export_atif(run, tmp_path / "out")
    assert report.ok, report.problems
    validate(report.written)
    doc = json.loads(report.written[0].read_text())
    entries = [json.loads(line) for line in (run / "turns" / "forked.0.jsonl").read_text().splitlines()]
    main = [s for s in doc["steps"] if s["source"] == "agent"]
    assert [s["message"] for s in main] == ["I will read stats.py first.",
                                            "The list is not sorted; sorting it fixes the bug."]
    assert [s["metrics"]["completion_token_ids"] for s in main] == [e["completion"]["tokens"]["output_ids"]
                                                                    for e in entries[:2]]
    subs = {s["trajectory_id"]: s for s in doc["subagent_trajectories"]}
    assert set(subs) == {"forked.0/branch-1", "forked.0/side-1"}
    branch = subs["forked.0/branch-1"]["steps"]
    assert [(s["source"], s.get("is_copied_context", False)) for s in branch] == [
        ("system", True), ("user", True), ("agent", True), ("user", False), ("agent", False)]
    assert branch[2]["llm_call_count"] == 0 and branch[4]["llm_call_count"] == 1
    assert branch[4]["message"] == "Running the tests: 2 failed."
    assert branch[4]["metrics"]["logprobs"] == pytest.approx(
        entries[2]["completion"]["tokens"]["output_logprobs"])
    side = subs["forked.0/side-1"]
    assert side["extra"]["kind"] == "side_call" and side["steps"][-1]["message"] == "Fixing the median bug"
    # Both begin after the second answer: linked from its step.
    refs = [r["trajectory_id"] for r in main[1]["observation"]["results"]
            for r in r["subagent_trajectory_ref"]]
    assert refs == ["forked.0/branch-1", "forked.0/side-1"]
    assert doc["extra"]["reward"] == 1.0


def _shape(doc: dict[str, Any]) -> list[Any]:
    """What a round trip must keep of a trajectory: each step's source, text, calls, results and ids."""
    out: list[Any] = []
    for t in [doc, *doc.get("subagent_trajectories", [])]:
        out.append([(s["source"], s["message"], s.get("reasoning_content"), s.get("tool_calls"),
                     [r.get("content") for r in s.get("observation", {}).get("results", [])
                      if not r.get("subagent_trajectory_ref")],
                     s.get("metrics", {}).get("completion_token_ids")) for s in t["steps"]])
    return out


@pytest.mark.slow
def test_atif_reads_back_into_a_run_the_viewer_serves(runs: dict[str, Path], tmp_path: Path) -> None:
    """The reverse: ATIF files (these exports, or a Harbor job's TRIAL/agent/trajectory.json) into a run
    directory (what ``ares-gateway view`` of an ATIF directory serves); exported again, every step is
    as it was."""
    import asyncio

    from ares_gateway.viewer import RunSource
    from bench.support.viewer_runs import build_run, forked_session

    run = asyncio.run(build_run(tmp_path / "forked", [("forked", 1.0, forked_session)]))
    first = tmp_path / "atif"
    export_atif(run, first)
    for key in ("codex", "tito"):
        export_atif(runs[key], first / key)
    # A Harbor job's layout: the trial's reward in its result.json.
    trial = tmp_path / "atif" / "job" / "cc-trial" / "agent"
    trial.mkdir(parents=True)
    doc = json.loads(export_atif(runs["cc"], tmp_path / "cc").written[0].read_text())
    del doc["extra"]
    (trial / "trajectory.json").write_text(json.dumps(doc))
    (trial.parent / "result.json").write_text(json.dumps({"verifier_result": {"rewards": {"reward": 1.0}}}))
    (first / "notes.json").write_text("{}")  # not a trajectory: skipped quietly

    back = tmp_path / "back"
    report = import_atif(first, back)
    assert report.ok, report.problems
    source = RunSource(back)
    try:
        rows = {r["key"]: r for r in source.rows()}
        assert set(rows) == {"forked.0", "fix-median-bug.0", "fix-median-bug.1", "job_cc-trial.0"}, rows
        rows = {r["task"]: r for r in source.rows()}
        assert rows["job/cc-trial"]["reward"] == 1.0 and rows["forked"]["reward"] == 1.0
        assert source.turn_count(rows["forked"]["key"]) == 4
    finally:
        source.close()

    again = export_atif(back, tmp_path / "again")
    assert again.ok, again.problems
    validate(again.written)
    was = json.loads((first / "forked.0.json").read_text())
    now = json.loads((tmp_path / "again" / "forked.0.json").read_text())
    assert _shape(now) == _shape(was)


@pytest.mark.slow
def test_bad_run_dirs_report_each_episode_and_export_the_rest(runs: dict[str, Path], tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(runs["tiny"], run, ignore=shutil.ignore_patterns("gateway-data"))
    good = (run / "turns" / "fix-median-bug.0.jsonl").read_text()
    row = json.loads((run / "episodes.jsonl").read_text())
    rows = [row, dict(row, task="gone", attempt=0), dict(row, task="old", attempt=0),
            dict(row, task="cut", attempt=1)]
    # A killed run: the last row half-written, and a turn log whose last line is cut.
    (run / "episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"task": "half", "att')
    (run / "turns" / "cut.1.jsonl").write_text(good + good.splitlines()[0][:40])
    # An older layout: entries without request and completion.
    (run / "turns" / "old.0.jsonl").write_text(json.dumps({"request_id": "r", "messages": []}) + "\n")
    # A turn log no row names (the run stopped between the two writes).
    (run / "turns" / "orphan.0.jsonl").write_text(good)

    proc = subprocess.run(cli("export", "--format", "atif", str(run), "--out", str(tmp_path / "out")),
                          cwd=REPO, capture_output=True, text=True, check=False)
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr
    assert "episodes.jsonl: line 5 is not JSON" in err
    assert "gone.0: no turns/gone.0.jsonl: not exported" in err
    assert "old.0: turn 1 skipped" in err and "old.0: no main-line turn could be read" in err
    assert "turns/cut.1.jsonl: line 3 is not JSON" in err
    assert "orphan.0: no line in episodes.jsonl" in err
    written = sorted(p.name for p in (tmp_path / "out").glob("*.json"))
    assert written == ["cut.1.json", "fix-median-bug.0.json", "orphan.0.json"]
    validate(sorted((tmp_path / "out").glob("*.json")))
    assert json.loads((tmp_path / "out" / "orphan.0.json").read_text())["extra"]["reward"] is None

    # Not a run directory at all: one line, exit status 2, nothing written.
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = subprocess.run(cli("export", "--format", "atif", str(empty), "--out", str(tmp_path / "none")),
                          cwd=REPO, capture_output=True, text=True, check=False)
    assert proc.returncode == 2 and "is not a run's output directory" in proc.stderr
    assert not (tmp_path / "none").exists()
    with pytest.raises(FileNotFoundError):
        export_atif(empty, tmp_path / "none")
