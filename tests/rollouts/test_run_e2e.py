"""End to end with the real mini-swe-agent CLI in real sandboxes: ``ares-gateway run`` as a user runs it.

* ``run examples-mswea --policy oracle`` reaches reward 1.0 on every bundled task (local and Docker);
* failing tests give 0.0, a time limit gives truncation (GatewayEnv, local);
* SIGINT to a running ``ares-gateway run`` leaves no container and no local sandbox behind, and
  results.json holds the episodes that finished.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ares_gateway import GatewayEnv
from ares_gateway.episodes.tasks import load_dataset
from ares_gateway.policies import make_policy
from tests.helpers import cli, wait_while_running

from .e2e import REPO, owned_containers, require_mini
from .test_env_and_runner import left_behind, play

TASKS = load_dataset("examples").tasks
BACKENDS = ["local", pytest.param("docker", marks=pytest.mark.docker)]


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "ARES_SANDBOX_LOCAL_ROOT": str(tmp_path / "sandboxes"), "PYTHONUNBUFFERED": "1"}


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_run_oracle_reaches_full_reward(backend: str, tmp_path: Path) -> None:
    require_mini(backend)
    out = tmp_path / "out"
    proc = subprocess.run(cli("run", "examples-mswea", "--policy", "oracle", "--sandbox", backend, "-n", "4",
                              "--out", str(out)),
                          cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=400,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())
    episodes = {e["task"]: e for e in doc["episodes"]}
    assert sorted(episodes) == sorted(t.name for t in TASKS)
    for name, e in episodes.items():
        assert e["reward"] == 1.0 and e["exit_reason"] == "completed", (name, e)
        assert e["turns"] >= 2
        log_dir = out / "logs" / f"{name}.0"
        assert json.loads((log_dir / "trajectory.json").read_text())  # mini-swe-agent's own trajectory
        turns = (out / "turns" / f"{name}.0.jsonl").read_text().splitlines()
        # the tool result reached the agent
        assert "[oracle] solution/solve.sh exited with status 0" in turns[1]
    assert doc["summary"]["mean_reward"] == 1.0 and doc["summary"]["pass@1"] == 1.0
    assert "mean reward: 1.000" in proc.stdout and "exit reason" in proc.stdout
    assert list((out / "tb").glob("events.out.tfevents.*"))
    assert left_behind(tmp_path / "sandboxes") == []


@pytest.mark.slow
async def test_mini_failing_tests_and_time_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_mini("local")
    monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(tmp_path / "sandboxes"))
    greet, median = (next(t for t in TASKS if t.name == n) for n in ("write-greeting-file", "fix-median-bug"))
    nothing = GatewayEnv(task=greet, harness="mini-swe-agent", sandbox="local")
    # mini-swe-agent needs ~10 s to start on a busy machine: the limit counts from its launch.
    sleepy = GatewayEnv(task=median, harness="mini-swe-agent", sandbox="local", time_limit=30)
    started = time.monotonic()
    try:
        (_, failed), (_, truncated) = await asyncio.gather(
            play(nothing, make_policy("scripted"), greet),
            play(sleepy, make_policy("scripted", commands=["sleep 100"]), median),
        )
    finally:
        await nothing.close()
        await sleepy.close()
    assert failed.reward == 0.0 and failed.discount == 0.0  # type: ignore[attr-defined]
    assert failed.info["exit_reason"] == "completed" and failed.info["agent_exit_code"] == 0  # type: ignore[attr-defined]
    assert truncated.discount == 1.0 and truncated.info["exit_reason"] == "time_limit"  # type: ignore[attr-defined]
    assert truncated.info["truncated"] is True and truncated.reward == 0.0  # type: ignore[attr-defined]
    assert time.monotonic() - started < 120
    assert left_behind(tmp_path / "sandboxes") == []


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_sigint_removes_every_sandbox_and_writes_what_finished(backend: str, tmp_path: Path) -> None:
    require_mini(backend)
    out, boxes = tmp_path / "out", tmp_path / "sandboxes"
    proc = subprocess.Popen(
        cli("run", "examples-mswea", "--policy", "oracle", "--sandbox", backend, "-n", "1",
            "--out", str(out)),
        cwd=REPO, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def finished_one_and_next_is_up() -> bool:
            done = (out / "episodes.jsonl").exists() and (out / "episodes.jsonl").read_text().strip()
            live = owned_containers(proc.pid) if backend == "docker" else left_behind(boxes)
            return bool(done and live)

        wait_while_running(proc, finished_one_and_next_is_up, timeout=240, what="no episode finished in time",
                           every=0.5)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, output[-3000:]
    assert "SIGINT: stopping" in output
    doc = json.loads((out / "results.json").read_text())
    assert doc["summary"]["interrupted"] is True
    assert len(doc["episodes"]) >= 1 and all(e["reward"] == 1.0 for e in doc["episodes"])
    assert len(doc["episodes"]) + len(doc["summary"]["cancelled"]) == len(TASKS)
    assert left_behind(boxes) == []
    if backend == "docker":
        assert owned_containers(proc.pid) == []


@pytest.mark.slow
@pytest.mark.docker
def test_gc_reaps_the_containers_of_a_sigkilled_run(tmp_path: Path) -> None:
    """SIGKILL leaves a gateway process no chance to clean up; `ares-gateway gc` then removes its
    containers."""
    require_mini("docker")
    env = _env(tmp_path)
    # The http policy leaves every request parked for a trainer that never comes: the sandboxes stay up.
    proc = subprocess.Popen(cli("run", "examples-mswea", "--policy", "http", "--sandbox", "docker", "-n", "2",
                                "--out", str(tmp_path / "out")),
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_while_running(proc, lambda: len(owned_containers(proc.pid)) >= 2, timeout=180,
                           what="the run's sandboxes did not come up", every=0.5)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert len(owned_containers(proc.pid)) >= 2  # nothing cleaned up after SIGKILL
    gc = subprocess.run(cli("gc"), cwd=REPO, env=env, capture_output=True, text=True, timeout=180,
                        check=False)
    assert gc.returncode == 0, gc.stdout + gc.stderr
    assert owned_containers(proc.pid) == [], gc.stdout
