"""Real-length episodes through the real ``ares-gateway run`` CLI (a subprocess, on its uvloop loop).

* an episode of over 90 s for each harness on the local sandbox, and for one on Docker: the scripted
  policy runs a command that sleeps 90 s and only then writes the answer aside, then moves it into
  place, so reward 1.0 needs the long command to have run to its end through the agent's own tool
  (mini-swe-agent kills a command after 30 s by default, Claude Code refuses a leading ``sleep``
  with background tasks on, Codex yields after 30 s at most and must be polled, Terminus-2 reads the
  screen after 60 s at most and must wait again);
* the oracle matrix: every harness reaches 1.0 on every bundled task on the local sandbox.

Every run is a separate CLI process; all the runs the selected tests need start together when the
first of them is set up (they mostly sleep), so the file takes about as long as its longest run.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ares_gateway.episodes.tasks import load_dataset
from tests.harnesses.conftest import require_backend
from tests.helpers import cli

from .e2e import REPO

HARNESSES = ["mini-swe-agent", "claude-code", "codex", "terminus-2"]
PRESET = {"mini-swe-agent": "examples-mswea", "claude-code": "examples-cc", "codex": "examples-codex",
          "terminus-2": "examples-terminus"}
TASKS = sorted(t.name for t in load_dataset("examples").tasks)
LONG_SECONDS = 90
#: The long command writes the answer aside only after sleeping; the second command moves it into
#: place. A long command cut short (or not waited for) leaves nothing to move: reward 0.
LONG_COMMANDS = [f"sleep {LONG_SECONDS} && echo 'Hello from ARES!' > .ares-long-done",
                 "mv .ares-long-done greeting.txt"]
#: Runs a CLI process may take before the test gives up (every run shares two busy cores).
RUN_TIMEOUT = 540


@dataclass
class CliRun:
    key: str
    args: list[str]
    out: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    started_at: float = 0.0
    wall: float | None = None
    rc: int | None = field(default=None)

    def start(self, env: dict[str, str]) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as fh:
            self.proc = subprocess.Popen([*cli(*self.args), "--out", str(self.out)], cwd=REPO, env=env,
                                         stdout=fh, stderr=subprocess.STDOUT)
        self.started = time.monotonic()
        self.started_at = time.time()

    def wait(self) -> CliRun:
        assert self.proc is not None
        if self.rc is None:
            deadline = self.started + RUN_TIMEOUT
            try:
                self.rc = self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                pytest.fail(
                    f"{self.key}: ares-gateway run did not end within {RUN_TIMEOUT} s:\n{self.output()}")
            results = self.out / "results.json"
            # The run's own wall time (it may have ended before this test waited for it).
            self.wall = (results.stat().st_mtime - self.started_at) if results.exists() else None
        return self

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""

    def results(self) -> dict[str, Any]:
        path = self.out / "results.json"
        assert path.is_file(), f"{self.key}: no results.json (rc {self.rc}):\n{self.output()}"
        doc: dict[str, Any] = json.loads(path.read_text())
        return doc


def _long(harness: str, backend: str) -> list[str]:
    args = ["run", f"{PRESET[harness]}:write-greeting-file", "--policy", "scripted", "--sandbox", backend,
            "--time-limit", "300"]
    for command in LONG_COMMANDS:
        args += ["--command", command]
    return args


def _oracle(harness: str) -> list[str]:
    return ["run", PRESET[harness], "--policy", "oracle", "--sandbox", "local", "-n", "4"]


PLANS: dict[str, tuple[str, str, list[str]]] = {
    **{f"long-local-{h}": (h, "local", _long(h, "local")) for h in HARNESSES},
    "long-docker-mini-swe-agent": ("mini-swe-agent", "docker", _long("mini-swe-agent", "docker")),
    **{f"oracle-local-{h}": (h, "local", _oracle(h)) for h in HARNESSES},
}


class Runs:
    """The CLI runs of this module, started together on first use."""

    def __init__(self, root: Path, keys: list[str]) -> None:
        self.root = root
        self.runs = {k: CliRun(k, PLANS[k][2], root / k / "out", root / k / "cli.log") for k in keys}
        env = {**os.environ, "ARES_SANDBOX_LOCAL_ROOT": str(root / "sandboxes"), "PYTHONUNBUFFERED": "1",
               "COLUMNS": "200"}
        for run in self.runs.values():
            run.start(env)

    def get(self, key: str) -> CliRun:
        harness, backend, _ = PLANS[key]
        require_backend(backend, harness)
        return self.runs[key].wait()

    def close(self) -> None:
        for run in self.runs.values():
            if run.proc is not None and run.proc.poll() is None:
                run.proc.kill()
                run.proc.wait()
        walls = {k: round(r.wall, 1) for k, r in self.runs.items() if r.wall is not None}
        (self.root / "walls.json").write_text(json.dumps(walls, indent=2))


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    # Start only the runs of the selected tests of this module, all at once.
    usable = [k for k in _selected_keys(request) if _usable(k)]
    started = Runs(tmp_path_factory.mktemp("real-length"), usable)
    yield started
    started.close()


def _selected_keys(request: pytest.FixtureRequest) -> list[str]:
    keys: set[str] = set()
    for item in request.session.items:
        if not isinstance(item, pytest.Function) or item.module is not request.module:
            continue
        callspec = getattr(item, "callspec", None)
        key = callspec.params.get("key") if callspec is not None else None
        if isinstance(key, str):
            keys.add(key)
    return sorted(keys)


def _usable(key: str) -> bool:
    harness, backend, _ = PLANS[key]
    try:
        require_backend(backend, harness)
    except (pytest.skip.Exception, pytest.fail.Exception):
        return False
    return True


def _one_episode(run: CliRun) -> dict[str, Any]:
    assert run.rc == 0, f"{run.key}: rc {run.rc}\n{run.output()}"
    doc = run.results()
    assert len(doc["episodes"]) == 1, doc["episodes"]
    episode: dict[str, Any] = doc["episodes"][0]
    return episode


@pytest.mark.slow
@pytest.mark.parametrize("key", [pytest.param(f"long-local-{h}", id=h) for h in HARNESSES])
def test_episode_over_90_s_on_the_local_sandbox(runs: Runs, key: str) -> None:
    run = runs.get(key)
    e = _one_episode(run)
    assert e["reward"] == 1.0 and e["exit_reason"] == "completed" and e["error"] is None, (e, run.output())
    assert e["duration"] >= LONG_SECONDS, e
    # The long command's own output reached the agent once it ended; the policy then took the next step.
    turns = (run.out / "turns" / "write-greeting-file.0.jsonl").read_text()
    assert "mv .ares-long-done greeting.txt" in turns


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.parametrize("key", [pytest.param("long-docker-mini-swe-agent", id="mini-swe-agent")])
def test_episode_over_90_s_on_docker(runs: Runs, key: str) -> None:
    run = runs.get(key)
    e = _one_episode(run)
    assert e["reward"] == 1.0 and e["exit_reason"] == "completed" and e["error"] is None, (e, run.output())
    assert e["duration"] >= LONG_SECONDS, e


@pytest.mark.slow
@pytest.mark.parametrize("key", [pytest.param(f"oracle-local-{h}", id=h) for h in HARNESSES])
def test_oracle_reaches_full_reward_on_every_task(runs: Runs, key: str) -> None:
    run = runs.get(key)
    assert run.rc == 0, f"{key}: rc {run.rc}\n{run.output()}"
    doc = run.results()
    episodes = {e["task"]: e for e in doc["episodes"]}
    assert sorted(episodes) == TASKS, run.output()
    for name, e in episodes.items():
        assert e["reward"] == 1.0 and e["exit_reason"] == "completed" and e["error"] is None, (key, name, e)
        # The solution ran through the agent's own shell tool and its result reached the agent.
        turns = (run.out / "turns" / f"{name}.0.jsonl").read_text()
        assert "[oracle] solution/solve.sh exited with status 0" in turns, (key, name)
    assert doc["summary"]["mean_reward"] == 1.0 and doc["summary"]["pass@1"] == 1.0
