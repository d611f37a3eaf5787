"""Infrastructure failures are retried on a fresh sandbox and, when they persist, never trained on;
agent failures are never retried. Real episodes: the tiny agent (a real process) in real local
sandboxes, answered by the oracle (or a scripted / failing policy), with faults injected by small
subclasses at the seams the episode uses: the sandbox factory (``sandbox.create``: a local sandbox
whose start or test upload fails) and the harness (an install that fails).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import sandbox as sandbox_mod
from ares_gateway import EpisodeConfig, RunConfig
from ares_gateway.episodes.episode import GRADING_LABEL
from ares_gateway.episodes.failures import INFRA_ERROR, classify
from ares_gateway.episodes.output import EpisodeResult, RunSummary, summary_lines
from ares_gateway.episodes.rollouts import run_rollouts
from ares_gateway.episodes.scheduler import run_with_retries
from ares_gateway.episodes.tasks import load_dataset
from ares_gateway.policies import FunctionPolicy, make_policy
from ares_gateway.trainers import EpisodeSample, exclude_infra_errors, play_episodes, trainer_entry
from harnesses import HarnessInstallError, registry
from harnesses.tiny_agent import TinyAgentHarness
from sandbox.local import LocalSandbox
from tests.helpers import left_behind

GREETING = {t.name: t for t in load_dataset("examples").tasks}["write-greeting-file"]


class Faults:
    """What the injected sandboxes do: ``fail_starts`` agent sandboxes fail to start (after ``ok_starts``
    started), ``fail_uploads`` grading sandboxes fail to take the tests. Counts what was made."""

    def __init__(self, *, fail_starts: int = 0, ok_starts: int = 0, fail_uploads: int = 0) -> None:
        self.fail_starts, self.ok_starts, self.fail_uploads = fail_starts, ok_starts, fail_uploads
        self.agent_sandboxes = 0
        self.grading_sandboxes = 0


def _faulty_class(faults: Faults) -> type[LocalSandbox]:
    class FaultyLocal(LocalSandbox):
        """A real local sandbox whose start or upload fails as ``faults`` says."""

        async def start(self) -> None:
            grading = GRADING_LABEL in self.spec.labels
            if not grading:
                faults.agent_sandboxes += 1
                if faults.agent_sandboxes > faults.ok_starts and faults.fail_starts > 0:
                    faults.fail_starts -= 1
                    raise sandbox_mod.SandboxStartError("injected: the sandbox did not start")
            else:
                faults.grading_sandboxes += 1
            await super().start()

        async def upload_dir(self, local_dir: Any, remote_dir: str) -> None:
            if GRADING_LABEL in self.spec.labels and faults.fail_uploads > 0:
                faults.fail_uploads -= 1
                raise sandbox_mod.SandboxError("injected: the tests could not be uploaded")
            await super().upload_dir(local_dir, remote_dir)

    return FaultyLocal


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch) -> Iterator[Faults]:
    """The sandbox factory (``sandbox.create``, which every episode calls) makes :class:`FaultyLocal`."""
    state = Faults()
    cls = _faulty_class(state)

    def create(spec: Any = None, backend: str = "auto", **options: Any) -> sandbox_mod.BaseSandbox:
        assert backend == "local"
        return cls(spec, **options)

    monkeypatch.setattr(sandbox_mod, "create", create)
    yield state


async def _run(policy: Any = None, *, harness: str = "tiny-agent", out: Path | None = None,
               retries: int = 2, attempts: int = 1) -> RunSummary:
    return await run_rollouts(
        [GREETING], policy=policy or make_policy("oracle"), episode=EpisodeConfig(harness, sandbox="local"),
        run=RunConfig(
            concurrency=1, attempts=attempts, out=out, stats="null", retries=retries, retry_backoff=0.05,
        ),
    )


# ----------------------------------------------------------------------------------------------
# classification


def _result(reason: str, *, turns: int = 0, crashed: bool = False) -> EpisodeResult:
    return EpisodeResult("t", 0, 0.0, turns, 1.0, reason, verifier_crashed=crashed)


def test_each_exit_reason_has_one_kind() -> None:
    assert classify(_result("sandbox_error")) == "infra"
    assert classify(_result("install_error")) == "infra"
    assert classify(_result("error")) == "infra"
    assert classify(_result(INFRA_ERROR)) == "infra"
    assert classify(_result("agent_error", turns=0)) == "infra"  # it never reached the policy
    assert classify(_result("completed", turns=3, crashed=True)) == "infra"
    assert classify(_result("agent_error", turns=2)) == "agent"
    for limit in ("memory_limit", "pids_limit", "disk_limit"):
        assert classify(_result(limit, turns=1)) == "agent"
    for judged in ("completed", "step_limit", "time_limit", "truncated", "cancelled"):
        assert classify(_result(judged, turns=1)) is None


async def test_retry_parameters_are_checked() -> None:
    with pytest.raises(ValueError, match="retries must be 0 or more"):
        await run_rollouts(
            [GREETING], policy=make_policy("oracle"), episode=EpisodeConfig("tiny-agent", sandbox="local"),
            run=RunConfig(retries=-1, stats="null"),
        )

    async def never(spec: Any) -> Any:
        raise AssertionError("not reached")

    with pytest.raises(ValueError, match="retry_backoff"):
        await run_with_retries(never, None, retries=1, backoff=-1.0)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- real episodes


async def test_a_sandbox_that_fails_to_start_once_is_retried_on_a_fresh_one(
        tmp_path: Path, sandbox_root: Path, faults: Faults) -> None:
    faults.fail_starts = 1
    out = tmp_path / "run"
    summary = await _run(out=out)
    [e] = summary.episodes
    assert (e.exit_reason, e.reward, e.retries) == ("completed", 1.0, 1), e
    assert e.retry_errors and e.retry_errors[0].startswith("sandbox_error: starting the local sandbox failed")
    assert "injected: the sandbox did not start" in e.retry_errors[0]
    assert faults.agent_sandboxes == 2  # a fresh sandbox for the retry
    assert not left_behind(sandbox_root)  # the failed try's sandbox was removed too
    doc = json.loads((out / "results.json").read_text())
    assert doc["summary"]["retries"] == 1 and doc["summary"]["infra_failures"] == 0
    assert doc["summary"]["agent_failures"] == 0 and doc["run"]["retries"] == 2
    assert doc["episodes"][0]["retries"] == 1


async def test_a_persistent_sandbox_failure_is_infra_error_and_never_trained(
        sandbox_root: Path, faults: Faults) -> None:
    # Attempt 0 runs; every agent sandbox after it fails to start: attempt 1 fails its 2 tries.
    faults.ok_starts, faults.fail_starts = 1, 100
    episodes = await play_episodes(
        [GREETING, GREETING], policy=make_policy("oracle"),
        episode=EpisodeConfig("tiny-agent", sandbox="local"), run=RunConfig(concurrency=1, retries=1),
    )
    judged, failed = episodes
    assert (judged.exit_reason, judged.reward, judged.excluded) == ("completed", 1.0, False)
    assert failed.exit_reason == INFRA_ERROR and failed.infra_error and failed.excluded
    assert failed.result is not None and failed.result.infra_cause == "sandbox_error"
    assert failed.result.retries == 1 and len(failed.result.retry_errors) == 1
    assert failed.error is not None and failed.error.startswith("sandbox_error on every one of 2 tries:")
    assert faults.agent_sandboxes == 3
    assert failed.sample is None and failed.reward == 1.0  # the group's judged mean: no baseline moved
    entry = trainer_entry(failed, eos_id=0)
    assert entry.excluded and not entry.sampled and entry.sampled_tokens == 0
    # (the oracle records no token ids: nothing to sample)
    assert not trainer_entry(judged, eos_id=0).excluded
    # The whole group dropped, as an option: every member excluded, equal rewards (no advantage).
    exclude_infra_errors(episodes, drop_group=True)
    assert all(ep.excluded and ep.reward == 0.0 and ep.sample is None for ep in episodes)
    assert all(trainer_entry(ep, eos_id=0).excluded for ep in episodes)
    assert not left_behind(sandbox_root)


async def test_an_infra_error_is_counted_apart_in_results_and_the_summary_line(
        tmp_path: Path, sandbox_root: Path, faults: Faults) -> None:
    faults.fail_starts = 100
    out = tmp_path / "run"
    summary = await _run(out=out, retries=0)
    [e] = summary.episodes
    assert (e.exit_reason, e.infra_cause, e.retries, e.samples) == (INFRA_ERROR, "sandbox_error", 0, 0)
    assert faults.agent_sandboxes == 1  # retries=0: one try
    doc = json.loads((out / "results.json").read_text())
    assert doc["summary"]["infra_failures"] == 1 and doc["summary"]["exit_reasons"] == {INFRA_ERROR: 1}
    assert any(line.startswith("infrastructure failures: 1 episode(s)") for line in summary_lines(summary))


class FlakyInstall(TinyAgentHarness):
    """The tiny agent whose first install fails (a registry hiccup, a half-written download)."""

    failures_left = 1

    async def install(self, sandbox: Any) -> Any:
        if FlakyInstall.failures_left > 0:
            FlakyInstall.failures_left -= 1
            raise HarnessInstallError("tiny-agent", "install", "injected: the download broke")
        return await super().install(sandbox)


async def test_an_install_failure_is_retried(sandbox_root: Path, faults: Faults) -> None:
    registry.register("flaky-install-agent", FlakyInstall)
    FlakyInstall.failures_left = 1
    summary = await _run(harness="flaky-install-agent")
    [e] = summary.episodes
    assert (e.exit_reason, e.reward, e.retries) == ("completed", 1.0, 1), e
    assert e.retry_errors[0].startswith("install_error:") and "the download broke" in e.retry_errors[0]
    assert faults.agent_sandboxes == 2 and not left_behind(sandbox_root)


async def test_a_verifier_crash_is_retried(sandbox_root: Path, faults: Faults) -> None:
    faults.fail_uploads = 1
    summary = await _run()
    [e] = summary.episodes
    assert (e.exit_reason, e.reward, e.retries, e.verifier_crashed) == ("completed", 1.0, 1, False), e
    assert "sandbox failure while verifying" in e.retry_errors[
        0] and "could not be uploaded" in e.retry_errors[0]
    assert faults.agent_sandboxes == 2 and faults.grading_sandboxes == 2 and not left_behind(sandbox_root)


async def test_agent_failures_are_never_retried(sandbox_root: Path, faults: Faults) -> None:
    # A wrong answer: the tests judge it, reward 0.
    wrong = make_policy("scripted", commands=["echo 'not the greeting' > /dev/null"])
    [e] = (await _run(wrong)).episodes
    assert (e.exit_reason, e.reward, e.retries) == ("completed", 0.0, 0), e
    assert faults.agent_sandboxes == 1

    # The agent exits non-zero after the policy answered it (with an error).
    async def broken(request: object) -> str:
        raise RuntimeError("the policy's own bug")

    summary = await _run(FunctionPolicy(broken))
    [e] = summary.episodes
    assert (e.exit_reason, e.retries) == ("agent_error", 0) and e.turns >= 1, e
    assert classify(e) == "agent" and summary.agent_failures == 1 and summary.infra_failures == 0
    assert faults.agent_sandboxes == 2  # one more: no retry
    assert not left_behind(sandbox_root)


def test_excluding_keeps_groups_without_infra_errors() -> None:
    eps = [EpisodeSample("a", 1.0, "completed"), EpisodeSample("a", 0.0, "completed"),
           EpisodeSample("b", 0.0, INFRA_ERROR), EpisodeSample("b", 0.5, "completed")]
    exclude_infra_errors(eps)
    assert [ep.excluded for ep in eps] == [False, False, True, False]
    assert eps[2].reward == 0.5
    exclude_infra_errors(eps, drop_group=True)
    assert [ep.excluded for ep in eps] == [False, False, True, True] and eps[0].reward == 1.0
