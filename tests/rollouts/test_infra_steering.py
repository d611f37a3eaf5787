"""A policy cannot steer its own failure into ``infra_error`` (which trainers leave out of training, so
that it would beat an honest reward of 0): a failure whose cause lies inside the agent's own sandbox
is the agent's once the policy answered one of its LLM calls (reward 0.0, trained on, one try), and
the infrastructure's before that (retried).

Real episodes through :func:`run_rollouts`: the tiny agent (a real process, as the agent's unprivileged
user) in real sandboxes (the hardened local backend; Docker where an engine answers), answered by the
scripted policy, whose commands run in the agent's shell. The paths:

* the agent's sandbox down at grading or while the agent runs. An unprivileged agent cannot bring its
  own sandbox down here (the local keeper is spared from the OOM killer and root's; Docker's init is
  root's), so the sandbox is taken down from outside after a turn, as the OOM killer takes a local
  keeper on a host without CAP_SYS_RESOURCE (its keeper killed), or as it is lost (removed);
* the copy of the workdir out of the agent's sandbox failing (injected at the archive: a root tar
  inside the sandbox reads whatever the agent leaves);
* ``[verifier] sandbox = "agent"``: the agent leaves a process that takes every pid of its sandbox the
  moment the verifier starts setting up, so the verifier's own commands cannot start (a real attack);
* each again with no answered LLM call (the agent CLI did it, or the sandbox went down, before the
  policy had a say): retried, ``infra_error`` when it persists; and the grading sandbox's own faults
  (it fails to start, the test upload fails in it) stay the infrastructure's after any number of turns.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import signal
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

import sandbox as sandbox_mod
from ares_gateway import EpisodeConfig, RunConfig
from ares_gateway.episodes.failures import AGENT_SANDBOX, GRADING_SANDBOX, INFRA_ERROR, classify
from ares_gateway.episodes.output import EpisodeResult, RunSummary
from ares_gateway.episodes.rollouts import run_rollouts
from ares_gateway.episodes.tasks import Task
from ares_gateway.policies import make_policy
from ares_gateway.policies.scripted import SessionScriptedPolicy
from harnesses import registry
from harnesses.tiny_agent import TinyAgentHarness
from sandbox.errors import FileTransferError
from tests.rollouts.e2e import require_backend
from tests.security.test_exploits import task_dir

BACKENDS = ["local", pytest.param("docker", marks=pytest.mark.docker)]
ANSWER_TEST_SH = ("#!/bin/sh\nif [ \"$(cat answer.txt 2>/dev/null)\" = 42 ]; then echo 1; else echo 0; fi "
                  "> $ARES_VERIFIER_DIR/reward.txt\n")
SOLVE = "echo 42 > answer.txt"

# Left running by the agent (out of its session): it takes most of the sandbox's pids at once (threads
# count; under the default limit of 1024, so no fork has been refused when the episode looks at its
# limits), waits for the verifier's tests directory to be made anew, then takes every pid left and
# keeps them, so that no command of the verifier's can start.
PID_HOG = """
import os, threading, time
def ident():
    try:
        st = os.stat("/tests")
        return (st.st_ino, st.st_ctime_ns)
    except OSError:
        return None
def take(n):
    made = 0
    while made < n:
        try:
            threading.Thread(target=time.sleep, args=(300,), daemon=True).start()
        except RuntimeError:
            return made
        made += 1
    return made
threading.stack_size(64 * 1024)
before = ident()
take(960)
while ident() in (None, before):
    time.sleep(0.0005)
end = time.time() + 300
while time.time() < end:
    if not take(1000):
        time.sleep(0.002)
"""
HOG = (f"printf %s {base64.b64encode(PID_HOG.encode()).decode()} | base64 -d > /tmp/hog.py && "
       "{ setsid nohup python3 /tmp/hog.py >/dev/null 2>&1 < /dev/null & } && echo hog started")


def _task(root: Path, *, agent_grading: bool = False) -> Task:
    name = "steer-agent" if agent_grading else "steer-fresh"
    return Task.load(task_dir(root, name, test_sh=ANSWER_TEST_SH, workspace=True,
                              toml_extra='sandbox = "agent"\n' if agent_grading else ""))


# --------------------------------------------------------------------------- seams

Hook = Callable[[Any], Awaitable[None]]


class Steered(TinyAgentHarness):
    """The tiny agent, with what happens around it set by the test: ``quiet`` replaces its command by
    one that never calls its LLM; ``after`` runs once the agent exited (before the episode grades);
    ``during`` runs while it runs (a second after it was launched). Counts the sandboxes it ran in."""

    quiet: ClassVar[str | None] = None
    after: ClassVar[Hook | None] = None
    during: ClassVar[Hook | None] = None
    sandboxes: ClassVar[list[Any]] = []

    def agent_command(self, ctx: Any, prep: Any, prompt: str) -> str:
        return Steered.quiet if Steered.quiet is not None else super().agent_command(ctx, prep, prompt)

    async def launch_and_wait(self, sandbox: Any, ctx: Any, prompt: str, time_budget: float) -> Any:
        Steered.sandboxes.append(sandbox)
        run = asyncio.ensure_future(super().launch_and_wait(sandbox, ctx, prompt, time_budget))
        if Steered.during is not None:
            await asyncio.sleep(1.0)
            await Steered.during(sandbox)
        result = await run
        if Steered.after is not None:
            await Steered.after(sandbox)
        return result


class HookedScripted(SessionScriptedPolicy):
    """The scripted policy that runs ``before_call[n]`` before answering its n-th call (0-based)."""

    def __init__(self, commands: list[str], before_call: dict[int, Callable[[], Awaitable[None]]]) -> None:
        super().__init__(commands=commands)
        self.before_call = before_call
        self.calls = 0

    async def __call__(self, request: Any, /) -> Any:
        n, self.calls = self.calls, self.calls + 1
        hook = self.before_call.get(n)
        if hook is not None:
            await hook()
        return await super().__call__(request)


@pytest.fixture
def steered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[type[Steered]]:
    monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(tmp_path / "sandboxes"))
    Steered.quiet, Steered.after, Steered.during, Steered.sandboxes = None, None, None, []
    registry.register("steered-tiny-agent", Steered, replace=True)
    yield Steered
    registry.unregister("steered-tiny-agent")
    Steered.quiet, Steered.after, Steered.during, Steered.sandboxes = None, None, None, []


async def _run(task: Task, backend: str, policy: Any = None, *, retries: int = 1, out: Path | None = None,
               time_limit: float = 90) -> EpisodeResult:
    summary: RunSummary = await run_rollouts(
        [task], policy=policy or make_policy("scripted", commands=[SOLVE]),
        episode=EpisodeConfig("steered-tiny-agent", sandbox=backend, time_limit=time_limit),
        run=RunConfig(concurrency=1, stats="null", retries=retries, retry_backoff=0.05, out=out),
    )
    [e] = summary.episodes
    return e


def _left(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) if root.exists() else []


def _agents_fault(e: EpisodeResult, tries_made: int) -> None:
    """Reward 0, the agent's, one try, never ``infra_error``."""
    assert e.exit_reason != INFRA_ERROR and e.turns >= 1, e
    assert (e.reward, e.retries, e.samples >= 0) == (0.0, 0, True), e
    assert e.failure_site == AGENT_SANDBOX and classify(e) == "agent", e
    assert tries_made == 1, tries_made


def _infras_fault(e: EpisodeResult, tries_made: int, cause: str) -> None:
    """Every try failed by the infrastructure (retries=1: two tries): ``infra_error``."""
    assert e.exit_reason == INFRA_ERROR and e.infra_cause == cause and e.turns == 0, e
    assert (e.reward, e.retries, e.samples) == (0.0, 1, 0) and len(e.retry_errors) == 1, e
    assert tries_made == 2, tries_made


async def _remove(sb: Any) -> None:
    """The sandbox lost from outside: stopped and removed under the episode."""
    await sb.stop()


async def _kill_keeper(sb: Any) -> None:
    """The local sandbox's keeper killed, as the OOM killer does where it is not spared: its namespaces
    and every process in them go with it; the sandbox is down though not stopped."""
    keeper = sb._keeper
    assert keeper is not None, "a hardened local sandbox has a keeper"
    os.killpg(keeper.pid, signal.SIGKILL)
    await asyncio.to_thread(keeper.wait, 10)
    probe = await sb.exec("echo alive", cwd="/", timeout=10)
    assert not probe.ok, "the sandbox still answers with its keeper gone"


async def _fail_archive(sb: Any) -> None:
    """The archive of the workdir fails (a tar that fails or runs out of time inside the sandbox)."""
    async def archive_dir(remote_dir: str, local_path: Any, *, limit: int) -> int:
        raise FileTransferError(
            f"tar of {remote_dir} in sandbox {sb.id} failed (exit 2): injected: timed out"
        )

    sb.archive_dir = archive_dir


# --------------------------------------------------------------------------- classify


def _r(reason: str, turns: int = 0, *, crashed: bool = False, site: str = "") -> EpisodeResult:
    return EpisodeResult("t", 0, 0.0, turns, 1.0, reason, verifier_crashed=crashed, failure_site=site)


@pytest.mark.parametrize(("result", "kind"), [
    # Always the infrastructure's.
    (_r("install_error"), "infra"), (_r("install_error", 3), "infra"),
    (_r("error"), "infra"), (_r("error", 3, site=AGENT_SANDBOX), "infra"),
    (_r(INFRA_ERROR, 2), "infra"),
    # The agent's sandbox failed while the agent ran: whose depends on whether the policy had a say.
    (_r("sandbox_error", 0, site=AGENT_SANDBOX), "infra"),
    (_r("sandbox_error", 1, site=AGENT_SANDBOX), "agent"),
    # A sandbox that never started, or the grading sandbox: the infrastructure's at any turn count.
    (_r("sandbox_error", 0), "infra"), (_r("sandbox_error", 5), "infra"),
    (_r("sandbox_error", 5, site=GRADING_SANDBOX), "infra"),
    # A verifier crash in the agent's sandbox (not running, the copy out of it, its setup in agent mode).
    (_r("completed", 0, crashed=True, site=AGENT_SANDBOX), "infra"),
    (_r("completed", 1, crashed=True, site=AGENT_SANDBOX), "agent"),
    (_r("time_limit", 4, crashed=True, site=AGENT_SANDBOX), "agent"),
    (_r("step_limit", 4, crashed=True, site=AGENT_SANDBOX), "agent"),
    # ... in the grading sandbox, or with no site recorded (an older record): the infrastructure's.
    (_r("completed", 3, crashed=True, site=GRADING_SANDBOX), "infra"),
    (_r("completed", 3, crashed=True), "infra"),
    # The agent crashed: the policy's once it answered.
    (_r("agent_error", 0), "infra"), (_r("agent_error", 2), "agent"),
    (_r("memory_limit", 1), "agent"), (_r("pids_limit", 0), "agent"), (_r("disk_limit", 3), "agent"),
    # Judged by the tests, or stopped by the run.
    (_r("completed", 3), None), (_r("step_limit", 3), None),
    (_r("time_limit", 3), None), (_r("truncated", 3), None),
    (_r("cancelled", 1), None), (_r("cancelled", 0), None),
    # ... unless the policy was never asked: an agent that ended (exit 0) or ran out of time before its
    # first LLM call says nothing of the policy.
    (_r("completed", 0), "infra"), (_r("time_limit", 0), "infra"), (_r("truncated", 0), "infra"),
    (_r("completed", 3, site=AGENT_SANDBOX), None),  # a site without a crash decides nothing
])
def test_classify_over_the_table(result: EpisodeResult, kind: str | None) -> None:
    assert classify(result) == kind


# --------------------------------------------------------------------------- the agent's sandbox down


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("grading", ["fresh", "agent"])
async def test_a_sandbox_removed_after_the_agents_turns_is_the_agents_failure(
        backend: str, grading: str, tmp_path: Path, steered: type[Steered]) -> None:
    """The agent solved it (1.0 if graded), then its sandbox was lost before the tests: reward 0.0, the
    agent's, one try (the tests could not have run; a retry would have given it the group's mean)."""
    require_backend(backend)
    steered.after = _remove
    e = await _run(_task(tmp_path / "tasks", agent_grading=grading == "agent"), backend)
    _agents_fault(e, len(steered.sandboxes))
    assert e.exit_reason == "completed" and e.verifier_crashed, e
    assert e.error is not None and "the sandbox is not running" in e.error, e
    assert _left(tmp_path / "sandboxes") == []


@pytest.mark.parametrize("grading", ["fresh", "agent"])
async def test_a_sandbox_whose_keeper_died_after_the_agents_turns_is_the_agents_failure(
        grading: str, tmp_path: Path, steered: type[Steered]) -> None:
    """Its keeper killed (the OOM killer's pick where the keeper is not spared): nothing runs in it any
    more, so the copy of the workdir out of it (fresh) or the verifier's setup in it (agent) fails."""
    require_backend("local")
    steered.after = _kill_keeper
    e = await _run(_task(tmp_path / "tasks", agent_grading=grading == "agent"), "local")
    _agents_fault(e, len(steered.sandboxes))
    assert e.exit_reason == "completed" and e.verifier_crashed, e
    expected = "archiving the workdir" if grading == "fresh" else "cannot create"
    assert e.error is not None and expected in e.error, e
    assert _left(tmp_path / "sandboxes") == []


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_sandbox_lost_while_the_agent_ran_after_a_turn_is_the_agents_failure(
        backend: str, tmp_path: Path, steered: type[Steered]) -> None:
    """``sandbox_error`` "the sandbox failed while the agent ran", after the policy answered a call."""
    require_backend(backend)

    async def lose() -> None:
        await steered.sandboxes[-1].stop()

    policy = HookedScripted(["echo 41 > answer.txt", SOLVE], {1: lose})
    e = await _run(_task(tmp_path / "tasks"), backend, policy)
    _agents_fault(e, len(steered.sandboxes))
    assert e.exit_reason == "sandbox_error" and not e.verifier_crashed, e
    assert e.error is not None and e.error.startswith("the sandbox failed while the agent ran"), e
    assert _left(tmp_path / "sandboxes") == []


@pytest.mark.parametrize(("when", "cause"), [("after", "completed"), ("during", "sandbox_error")])
async def test_the_sandbox_lost_before_any_llm_call_is_still_retried(
        when: str, cause: str, tmp_path: Path, steered: type[Steered]) -> None:
    """The same loss when the agent never called its LLM (the policy had no say): the
    infrastructure's, retried on a fresh sandbox, ``infra_error`` when it persists."""
    require_backend("local")
    steered.quiet = "true" if when == "after" else "sleep 60"
    if when == "after":
        steered.after = _remove
    else:
        steered.during = _remove
    e = await _run(_task(tmp_path / "tasks"), "local")
    _infras_fault(e, len(steered.sandboxes), cause)
    assert _left(tmp_path / "sandboxes") == []


# --------------------------------------------------------------------------- the copy out of it


async def test_a_workdir_copy_that_fails_after_the_agents_turns_is_the_agents_failure(
        tmp_path: Path, steered: type[Steered]) -> None:
    require_backend("local")
    steered.after = _fail_archive
    out = tmp_path / "out"
    e = await _run(_task(tmp_path / "tasks"), "local", out=out)
    _agents_fault(e, len(steered.sandboxes))
    assert e.exit_reason == "completed" and e.verifier_crashed and e.grading == "fresh", e
    assert e.error is not None and "archiving the workdir" in e.error and "injected" in e.error, e
    assert _left(tmp_path / "sandboxes") == []


async def test_a_workdir_copy_that_fails_before_any_llm_call_is_retried(
        tmp_path: Path, steered: type[Steered]) -> None:
    require_backend("local")
    steered.quiet, steered.after = "echo 42 > answer.txt", _fail_archive
    e = await _run(_task(tmp_path / "tasks"), "local")
    _infras_fault(e, len(steered.sandboxes), "completed")
    assert "archiving the workdir" in e.retry_errors[0], e
    assert _left(tmp_path / "sandboxes") == []


# --------------------------------------------------------------------------- grading in the agent's sandbox


@pytest.mark.parametrize("backend", BACKENDS)
async def test_breaking_the_verifiers_setup_in_its_own_sandbox_is_the_agents_failure(
        backend: str, tmp_path: Path, steered: type[Steered]) -> None:
    """``[verifier] sandbox = "agent"``: the agent solves the task and leaves a process that takes every
    pid once the verifier starts, so the verifier's setup cannot run (a crash that, as the
    infrastructure's, would have been retried into ``infra_error``): reward 0.0, the agent's.

    On a loaded machine the verifier may win the race with the hog's last threads: test.sh then starts in
    a sandbox with no pid left and judges 0.0 itself, or (the hog not scheduled before the tests ended)
    runs whole and judges the solved task 1.0. Whichever way the race goes, the verdict is the tests' or
    the agent's own, one try, and never ``infra_error``."""
    require_backend(backend)
    e = await _run(_task(tmp_path / "tasks", agent_grading=True), backend,
                   make_policy("scripted", commands=[SOLVE, HOG]))
    assert e.exit_reason == "completed" and e.grading == "agent", e
    if e.verifier_crashed:
        _agents_fault(e, len(steered.sandboxes))
    else:  # the tests ran: judged by them (0.0 when the hog left them no pid, 1.0 when it came too late)
        assert e.reward in (0.0, 1.0), e
        assert (e.retries, e.failure_site, classify(e)) == (0, "", None), e
        assert len(steered.sandboxes) == 1 and e.turns >= 1, e
    assert _left(tmp_path / "sandboxes") == []


async def test_the_same_setup_failure_before_any_llm_call_is_retried(
        tmp_path: Path, steered: type[Steered]) -> None:
    """The agent CLI itself (no LLM call) left the process: the policy had no say, so it is retried."""
    require_backend("local")
    steered.quiet = f"{SOLVE} && {HOG} && sleep 0.5"
    e = await _run(_task(tmp_path / "tasks", agent_grading=True), "local")
    _infras_fault(e, len(steered.sandboxes), "completed")
    assert _left(tmp_path / "sandboxes") == []


# --------------------------------------------------------------------------- the grading sandbox's own faults


class _GradingFaults:
    start = 0
    upload = 0


@pytest.fixture
def grading_faults(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[_GradingFaults]]:
    """The grading sandbox (local) refuses to start, or to take the tests, as many times as set."""
    from ares_gateway.episodes.episode import GRADING_LABEL

    real_start, real_upload = sandbox_mod.LocalSandbox._start, sandbox_mod.LocalSandbox.upload_dir

    async def start(self: Any) -> None:
        if GRADING_LABEL in self.spec.labels and _GradingFaults.start > 0:
            _GradingFaults.start -= 1
            raise sandbox_mod.SandboxStartError("injected: no room for the grading sandbox")
        await real_start(self)

    async def upload_dir(self: Any, local_dir: Any, remote_dir: str) -> None:
        if GRADING_LABEL in self.spec.labels and _GradingFaults.upload > 0:
            _GradingFaults.upload -= 1
            raise sandbox_mod.SandboxError("injected: the tests could not be uploaded")
        await real_upload(self, local_dir, remote_dir)

    monkeypatch.setattr(sandbox_mod.LocalSandbox, "_start", start)
    monkeypatch.setattr(sandbox_mod.LocalSandbox, "upload_dir", upload_dir)
    _GradingFaults.start = _GradingFaults.upload = 0
    yield _GradingFaults
    _GradingFaults.start = _GradingFaults.upload = 0


@pytest.mark.parametrize("fault", ["start", "upload"])
async def test_the_grading_sandboxs_own_faults_stay_infrastructure_after_turns(
        fault: str, tmp_path: Path, steered: type[Steered], grading_faults: type[_GradingFaults]) -> None:
    """The grading sandbox did not start, or the tests could not be uploaded into it before anything
    of the agent's was there: the infrastructure's however many turns the policy took (retried; a
    fresh try solves it)."""
    require_backend("local")
    setattr(grading_faults, fault, 1)
    e = await _run(_task(tmp_path / "tasks"), "local",
                   make_policy("scripted", commands=["echo 41 > answer.txt", SOLVE]))
    assert (e.exit_reason, e.reward, e.retries) == ("completed", 1.0, 1), e
    reason = "sandbox_error: starting the local grading sandbox failed" if fault == "start" else \
        "completed: sandbox failure while verifying"
    assert e.retry_errors[0].startswith(reason), e.retry_errors
    assert len(steered.sandboxes) == 2
    assert _left(tmp_path / "sandboxes") == []


async def test_the_outcome_says_where_the_failure_lay(tmp_path: Path, steered: type[Steered]) -> None:
    """results.json carries ``failure_site``; the summary counts the episode as the agent's."""
    import json

    require_backend("local")
    steered.after = _remove
    out = tmp_path / "out"
    e = await _run(_task(tmp_path / "tasks"), "local", out=out)
    doc = json.loads((out / "results.json").read_text())
    [entry] = doc["episodes"]
    assert entry["failure_site"] == AGENT_SANDBOX and entry["verifier_crashed"] is True, entry
    assert doc["summary"]["agent_failures"] == 1 and doc["summary"]["infra_failures"] == 0, doc["summary"]
    assert e.failure_site == AGENT_SANDBOX
    with contextlib.suppress(FileNotFoundError):
        assert "failure_site" in (out / "episodes.jsonl").read_text()
