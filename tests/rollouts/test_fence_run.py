"""A weight-update fence in the middle of a real run: tiny-agent episodes in local sandboxes, answered in
process by the oracle policy (slowed, so a generation is in flight at the fence), an abort fence
between turns. Nothing is lost, the aborted turn is recorded once with the version set at the resume,
and the run's TensorBoard scalars hold the fence's drain and pause times."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from ares_gateway import EpisodeConfig, Gateway, RunConfig
from ares_gateway.episodes.episode import harness_side_call_detector
from ares_gateway.episodes.rollouts import run_rollouts
from ares_gateway.episodes.tasks import load_dataset
from ares_gateway.policies import make_policy
from harnesses.tiny_agent import TinyAgentHarness

pytestmark = pytest.mark.asyncio

TASKS = load_dataset("examples").tasks[:2]


class SlowOracle:
    """The oracle policy, each call ``delay`` seconds late; counts the calls that started."""

    def __init__(self, delay: float) -> None:
        self.inner: Any = make_policy("oracle")
        self.delay = delay
        self.started = 0
        self.first = asyncio.Event()

    def bind(self, session_id: str, *, agent: str, task: Any = None) -> None:
        self.inner.bind(session_id, agent=agent, task=task)

    def unbind(self, session_id: str) -> None:
        self.inner.unbind(session_id)

    async def __call__(self, request: Any) -> Any:
        self.started += 1
        self.first.set()
        await asyncio.sleep(self.delay)
        return await self.inner(request)


async def test_an_abort_fence_mid_run_loses_nothing_and_is_in_tensorboard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(tmp_path / "sandboxes"))
    out = tmp_path / "run"
    policy = SlowOracle(delay=1.0)
    async with Gateway(port=0, side_call_detector=harness_side_call_detector(TinyAgentHarness)) as gw:
        gw.set_policy_version(0)

        async def fence() -> None:
            await policy.first.wait()
            await asyncio.sleep(0.2)  # the first generations are in flight now
            async with gw.weight_update(1, mode="abort", timeout=30) as report:
                assert report.aborted >= 1
                await asyncio.sleep(0.5)  # "mutating the weights"

        fencing = asyncio.create_task(fence())
        summary = await run_rollouts(
            TASKS, policy=policy, gateway=gw, episode=EpisodeConfig("tiny-agent", sandbox="local"),
            run=RunConfig(concurrency=2, out=out, stats_period=0),
        )
        await fencing
    assert [e.reward for e in summary.episodes] == [1.0] * len(TASKS)
    assert all(e.exit_reason == "completed" and e.turns == 2 for e in summary.episodes)
    # The aborted generations ran again: more calls started than turns were answered, and each turn is
    # recorded once, the re-sampled ones with the version set at the resume.
    assert policy.started > 2 * len(TASKS)
    for e in summary.episodes:
        key = f"{e.task}.{e.attempt}"
        turns = [json.loads(line) for line in (out / "turns" / f"{key}.jsonl").read_text().splitlines()]
        # Both episodes' first generations were in flight at the fence (1 s each, fenced at 0.2 s): aborted,
        # sampled again after the resume, recorded once, with version 1.
        assert [t.get("policy_version") for t in turns] == [1, 1]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    [drain] = acc.Scalars("fence/drain_seconds")
    [paused] = acc.Scalars("fence/paused_seconds")
    assert 0 <= drain.value < 5 and paused.value >= 0.5
    root = tmp_path / "sandboxes"
    assert not root.exists() or list(root.iterdir()) == []


async def test_a_local_executor_carries_versions_and_the_fence_to_its_gateway(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The executor's own calls (what a trainer driving any executor uses): a version set before the run
    reaches the gateway the executor builds, a weight_update mid-run drains it, and bad calls raise the
    gateway's errors."""
    from ares_gateway.core.errors import (
        InvalidFenceError,
        InvalidPolicyVersionError,
        PolicyVersionBackwardsError,
        SamplingNotPausedError,
        SamplingPausedError,
    )
    from ares_gateway.episodes.executor import Executor, LocalExecutor

    monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(tmp_path / "sandboxes"))
    ex = LocalExecutor(concurrency=2)
    assert isinstance(ex, Executor)
    # Before start: a version is kept for the gateway start() builds; there is nothing to pause yet.
    with pytest.raises(RuntimeError, match="before start"):
        await ex.pause_sampling()
    with pytest.raises(SamplingNotPausedError):
        await ex.resume_sampling(1)
    await ex.set_policy_version(2)
    with pytest.raises(PolicyVersionBackwardsError):
        await ex.set_policy_version(1)
    with pytest.raises(InvalidPolicyVersionError):
        await ex.set_policy_version("3")  # type: ignore[arg-type]
    assert ex.policy_version == 2

    policy = SlowOracle(delay=1.0)
    fenced: dict[str, Any] = {}

    async def fence() -> None:
        while policy.started < len(TASKS):  # noqa: ASYNC110 (every episode's first generation in flight)
            await asyncio.sleep(0.05)
        assert ex.gateway is not None and ex.gateway.policy_version == 2
        with pytest.raises(InvalidFenceError):
            await ex.pause_sampling("later")
        fenced["paused_at"] = time.time()
        async with ex.weight_update(3, timeout=30) as report:
            with pytest.raises(SamplingPausedError):
                await ex.pause_sampling()
            fenced["report"] = report
            await asyncio.sleep(0.3)  # "mutating the weights"
        fenced["resumed_at"] = time.time()
        with pytest.raises(SamplingNotPausedError):
            await ex.resume_sampling()

    fencing = asyncio.create_task(fence())
    out = tmp_path / "run"
    summary = await run_rollouts(
        TASKS, policy=policy, episode=EpisodeConfig("tiny-agent", sandbox="local"),
        run=RunConfig(out=out, executor=ex, stats="null"),
    )
    await fencing
    report = fenced["report"]
    assert report.mode == "drain" and report.in_flight >= 1 and report.aborted == 0, report
    assert [e.reward for e in summary.episodes] == [1.0] * len(TASKS)
    assert all(e.turns == 2 for e in summary.episodes)  # no turn lost
    for e in summary.episodes:
        turns = [json.loads(line) for line in (out / "turns" / f"{e.key}.jsonl").read_text().splitlines()]
        # The drained turns kept the old version; every turn answered after the resume has the new one.
        assert [t["policy_version"] for t in turns] == [2, 3], turns
        assert all(t["timestamp"] > fenced["paused_at"] for t in turns if t["policy_version"] == 3)
    # The version outlives the run's gateway, and still only goes up.
    assert ex.gateway is None and ex.policy_version == 3
    with pytest.raises(PolicyVersionBackwardsError):
        await ex.set_policy_version(2)
