"""The warm pool (``run --warm N``): episodes set up ahead, each warm sandbox used by one episode.

Real episodes through :func:`run_rollouts` and the real ``ares-gateway run``: the tiny agent (a real
process, the agent's unprivileged user) in hardened local sandboxes and, where an engine answers,
Docker containers; answered by the oracle or the scripted policy.

* episodes from the pool score as cold ones do (the oracle on every bundled task), and say they were warm;
* what an agent plants in its sandbox (a file in /tmp, a detached process) is not there for the next
  episode: each warm sandbox serves one episode;
* a set-up that fails ahead is the episode's infrastructure failure, retried on a fresh (cold) sandbox;
* Ctrl-C during a run leaves no sandbox of the pool, set up or being set up; after SIGKILL,
  `ares-gateway gc` removes them;
* bad sizes are refused by name.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import sandbox as sandbox_mod
from ares_gateway import EpisodeConfig, RunConfig
from ares_gateway.episodes.episode import EpisodeSetupError, TaskEpisode
from ares_gateway.episodes.executor import LocalExecutor
from ares_gateway.episodes.output import RunSummary
from ares_gateway.episodes.rollouts import run_rollouts
from ares_gateway.episodes.tasks import Task, load_dataset
from ares_gateway.episodes.warm import WARM_LABEL, WarmPool
from ares_gateway.gateway import Gateway
from ares_gateway.policies import make_policy
from tests.helpers import cli, left_behind, wait_while_running
from tests.rollouts.e2e import REPO, owned_containers, require_backend
from tests.security.test_exploits import task_dir

BACKENDS = ["local", pytest.param("docker", marks=pytest.mark.docker)]
TASKS = load_dataset("examples").tasks

# The agent's first command: what it finds of an earlier episode goes into seen.txt (graded), then it
# plants a file and a detached process of its own for a later episode to find.
PROBE_AND_PLANT = (
    "{ test -e /tmp/ares-planted && echo file; "
    "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f 2>/dev/null; echo; done | grep -c '^sleep 3001' "
    "| grep -v '^0$' | sed 's/^/processes /'; } > seen.txt; "
    "echo planted > /tmp/ares-planted; "
    "{ setsid nohup sleep 3001 >/dev/null 2>&1 < /dev/null & } ; echo planted"
)
SAW_NOTHING_SH = ("#!/bin/sh\nif [ -e seen.txt ] && [ ! -s seen.txt ]; then echo 1; else echo 0; fi "
                  "> $ARES_VERIFIER_DIR/reward.txt\n")


@pytest.fixture
def boxes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = tmp_path / "sandboxes"
    monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(root))
    yield root


def _warm_containers(pid: int) -> list[str]:
    """Containers (any state) that carry the warm label and whose owner label names process ``pid``."""
    out = subprocess.run(["docker", "ps", "-a", "--filter", f"label={WARM_LABEL}", "--format",
                          '{{.ID}} {{.Label "ares-gateway.owner"}}'],
                         capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if f":{pid}:" in line]


async def _run(tasks: Sequence[Task], backend: str, policy: Any, **kw: Any) -> RunSummary:
    return await run_rollouts(
        tasks, policy=policy, episode=EpisodeConfig("tiny-agent", sandbox=backend),
        run=RunConfig(stats="null", **kw),
    )


@pytest.mark.parametrize("backend", BACKENDS)
async def test_warm_episodes_score_as_cold_ones(backend: str, boxes: Path) -> None:
    require_backend(backend)
    cold = await _run(TASKS, backend, make_policy("oracle"), concurrency=2)
    warm = await _run(TASKS, backend, make_policy("oracle"), concurrency=2, warm=3)
    scores = {r.key: (r.reward, r.exit_reason) for r in cold.episodes}
    assert len(scores) == len(TASKS) and set(scores.values()) == {(1.0, "completed")}, cold.episodes
    assert {r.key: (r.reward, r.exit_reason) for r in warm.episodes} == scores
    assert not any(r.warm for r in cold.episodes)
    assert all(r.warm and r.setup_seconds > 0 and r.retries == 0 for r in warm.episodes), warm.episodes
    assert left_behind(boxes) == []
    if backend == "docker":
        assert _warm_containers(os.getpid()) == []


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_warm_sandbox_serves_one_episode(backend: str, tmp_path: Path, boxes: Path) -> None:
    """One episode at a time, the pool two ahead: each agent plants a file and a process, and the next
    episode's agent (in a sandbox set up while the planting one ran) finds neither."""
    require_backend(backend)
    task = Task.load(task_dir(tmp_path / "tasks", "plant", test_sh=SAW_NOTHING_SH, workspace=True))
    summary = await _run([task], backend, make_policy("scripted", commands=[PROBE_AND_PLANT]), concurrency=1,
                         attempts=4, warm=2)
    assert [(r.attempt, r.reward, r.warm) for r in sorted(summary.episodes, key=lambda r: r.attempt)] == \
        [(a, 1.0, True) for a in range(4)], summary.episodes
    assert left_behind(boxes) == []


async def test_the_probe_sees_what_a_sandbox_kept(tmp_path: Path, boxes: Path) -> None:
    """The probe above can fail: in one sandbox, after the planting command, it reports both."""
    require_backend("local")
    sb = sandbox_mod.create(sandbox_mod.SandboxSpec(hardened=True, network="none"), backend="local")
    await sb.start()
    try:
        first = await sb.exec(PROBE_AND_PLANT, cwd="/tmp", timeout=30)
        assert first.ok, first.stderr
        again = await sb.exec(PROBE_AND_PLANT, cwd="/tmp", timeout=30)
        assert again.ok and (await sb.exec("cat /tmp/seen.txt", timeout=30)).stdout.split() == \
            ["file", "processes", "1"]
    finally:
        await sb.stop()


async def test_a_failed_warm_set_up_is_retried_on_a_cold_sandbox(
        boxes: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first warm set-up's sandbox does not start: that episode fails as the infrastructure's and
    its retry sets up cold; the others come warm."""
    require_backend("local")
    real = TaskEpisode.prepare
    failed: list[str] = []

    async def prepare(self: TaskEpisode, session: Any) -> None:
        if self.warm and not failed:
            failed.append(self.task.name)
            self.session = session
            self.setup_error = EpisodeSetupError("sandbox_error", "starting the sandbox failed: injected")
            raise self.setup_error
        await real(self, session)

    monkeypatch.setattr(TaskEpisode, "prepare", prepare)
    tasks = TASKS[:3]
    summary = await _run(tasks, "local", make_policy("oracle"), concurrency=1, warm=2, retry_backoff=0.01)
    by = {r.task: r for r in summary.episodes}
    assert failed == [tasks[0].name]
    first = by[tasks[0].name]
    assert (first.reward, first.retries, first.warm) == (1.0, 1, False), first
    assert "injected" in first.retry_errors[0]
    assert all(by[t.name].warm and by[t.name].reward == 1.0 for t in tasks[1:]), summary.episodes
    assert left_behind(boxes) == []


async def test_closing_the_pool_removes_what_it_set_up_and_what_it_is_setting_up(boxes: Path) -> None:
    require_backend("local")
    from ares_gateway.episodes.driver import EpisodeSpec

    async with Gateway() as gw:
        pool = WarmPool(gw, 3)
        pool.expect([EpisodeSpec(t, 0, EpisodeConfig("tiny-agent", sandbox="local")) for t in TASKS])
        deadline = time.monotonic() + 60
        while len(left_behind(boxes)) < 3:  # three sandboxes set up or being set up
            assert time.monotonic() < deadline, left_behind(boxes)
            await _sleep(0.05)
        assert len(gw.sessions) == 3
        await pool.close()
        assert left_behind(boxes) == [] and len(gw.sessions) == 0
        assert pool.stats.started == 3 and pool.stats.discarded == 3
        assert await pool.take(EpisodeSpec(TASKS[3], 0, EpisodeConfig("tiny-agent", sandbox="local"))) is None


async def _sleep(s: float) -> None:
    import asyncio

    await asyncio.sleep(s)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sigint_leaves_no_warm_sandbox(backend: str, tmp_path: Path) -> None:
    """Ctrl-C while one episode waits for a trainer that never comes and three more are set up ahead."""
    require_backend(backend)
    out, boxes = tmp_path / "out", tmp_path / "sandboxes"
    env = {**os.environ, "ARES_SANDBOX_LOCAL_ROOT": str(boxes), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cli("run", "examples-tiny", "--attempts", "2", "--policy", "http", "--sandbox",
                                backend, "-n", "1", "--warm", "3", "--out", str(out)),
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # The running episode's sandbox and the pool's.
        wait_while_running(proc, lambda: len(owned_containers(proc.pid) if backend == "docker"
                                             else left_behind(boxes)) >= 4,
                           timeout=120, what="the pool did not fill in time", every=0.2)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, output[-3000:]
    assert left_behind(boxes) == []
    if backend == "docker":
        assert owned_containers(proc.pid) == []
    doc = json.loads((out / "results.json").read_text())
    assert doc["run"]["warm"] == 3 and doc["summary"]["interrupted"] is True


def test_bad_pool_sizes_are_refused_by_name(tmp_path: Path) -> None:
    bad = subprocess.run(cli("run", "examples-tiny", "--policy", "oracle", "--warm", "-1", "--out",
                             str(tmp_path / "o")), cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--warm must be 0 or more" in bad.stderr + bad.stdout
    for size in (-1, 1.5, True):
        with pytest.raises(ValueError, match="warm must be a whole number"):
            LocalExecutor(warm=size)  # type: ignore[arg-type]


async def test_warm_goes_to_the_executor_not_to_run_rollouts() -> None:
    with pytest.raises(ValueError, match=r"pass warm= to the executor"):
        await run_rollouts(
            TASKS, policy=make_policy("oracle"), episode=EpisodeConfig("tiny-agent"),
            run=RunConfig(executor=LocalExecutor(), warm=2, stats="null"),
        )


async def test_a_trainers_batch_plays_from_the_pool(boxes: Path) -> None:
    """``play_episodes(warm=...)`` (what the TRL and SkyRL adapters call per batch): a group of two per
    task, one at a time, each entry's episode set up ahead."""
    require_backend("local")
    from ares_gateway.trainers.episodes import play_episodes

    tasks = [t for t in TASKS[:2] for _ in range(2)]
    played = await play_episodes(
        tasks, policy=make_policy("oracle"), episode=EpisodeConfig("tiny-agent", sandbox="local"),
        run=RunConfig(concurrency=1, warm=2),
    )
    assert [p.task for p in played] == [t.name for t in tasks]
    assert all(p.reward == 1.0 and p.result is not None and p.result.warm for p in played), played
    assert left_behind(boxes) == []


@pytest.mark.docker
def test_gc_reaps_the_warm_containers_of_a_sigkilled_run(tmp_path: Path) -> None:
    """SIGKILL gives the pool no chance to close; ``ares-gateway gc`` removes its containers with the rest."""
    require_backend("docker")
    env = {**os.environ, "ARES_SANDBOX_LOCAL_ROOT": str(tmp_path / "sandboxes"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cli("run", "examples-tiny", "--policy", "http", "--sandbox", "docker", "-n", "1",
                                "--warm", "2", "--out", str(tmp_path / "out")),
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    try:
        # The running episode's containers (agent, grading) and the next one's, at least.
        wait_while_running(proc, lambda: len(_warm_containers(proc.pid)) >= 3, timeout=180,
                           what="the pool's sandboxes did not come up")
        time.sleep(1.0)  # let set-ups under way create their containers too
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert len(_warm_containers(proc.pid)) >= 3  # nothing cleaned up after SIGKILL
    gc = subprocess.run(cli("gc"), cwd=REPO, env=env, capture_output=True, text=True, timeout=180,
                        check=False)
    assert gc.returncode == 0, gc.stdout + gc.stderr
    assert _warm_containers(proc.pid) == [] and owned_containers(proc.pid) == [], gc.stdout
