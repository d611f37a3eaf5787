"""The streaming rollout source over real episodes: tiny-agent in local sandboxes, every call answered in
process by the oracle policy, its answers carrying token records (so the episodes have samples with
versions). Groups complete with every attempt; a slow consumer holds launches back; a weight update
fenced through the source mid-stream gives an episode of two versions, and staleness masks the old one;
close() mid-run leaves nothing behind and writes results.json; the blocking wrapper from plain threads;
bad input."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from ares_gateway import (
    BlockingRolloutSource,
    EpisodeConfig,
    Gateway,
    NoFenceError,
    RolloutSource,
    RolloutSourceError,
    RunConfig,
    SourceClosedError,
)
from ares_gateway.core.canonical import TokenRecord
from ares_gateway.episodes.driver import EpisodeRecord, EpisodeSpec
from ares_gateway.episodes.episode import harness_side_call_detector
from ares_gateway.episodes.executor import LocalExecutor
from ares_gateway.episodes.tasks import load_dataset
from ares_gateway.policies import make_policy
from harnesses.tiny_agent import TinyAgentHarness
from tests.helpers import left_behind

TASKS = load_dataset("examples").tasks


class TokenOracle:
    """The oracle policy, each answer ``delay`` seconds late and carrying a token record: each turn's prompt
    extends the session's tokens so far, so an episode's turns make one sample."""

    def __init__(self, delay: float = 0.0) -> None:
        self.inner: Any = make_policy("oracle")
        self.delay = delay
        self.answered = 0
        self.two_answered = asyncio.Event()
        self._tokens: dict[str, list[int]] = {}

    def bind(self, session_id: str, *, agent: str, task: Any = None) -> None:
        self.inner.bind(session_id, agent=agent, task=task)

    def unbind(self, session_id: str) -> None:
        self.inner.unbind(session_id)
        self._tokens.pop(session_id, None)

    async def __call__(self, request: Any) -> Any:
        await asyncio.sleep(self.delay)
        completion = await self.inner(request)
        sid = request.session_id
        prompt = [*self._tokens.get(sid, []), 7, 8]
        output = [100 + len(prompt) % 50, 101, 102]
        self._tokens[sid] = prompt + output
        self.answered += 1
        if self.answered >= 2:
            self.two_answered.set()
        tokens = TokenRecord(prompt_ids=prompt, output_ids=output, output_logprobs=[-0.25] * len(output))
        return completion.model_copy(update={"tokens": tokens})


class CountingExecutor(LocalExecutor):
    """The local executor, counting the episodes it was given to run."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.launched = 0

    async def run(self, spec: EpisodeSpec) -> EpisodeRecord:
        self.launched += 1
        return await super().run(spec)


class NoFenceExecutor:
    """A real executor (a local one inside) that offers no fence and no gateway of its own."""

    kind = "bare"

    def __init__(self) -> None:
        self._inner = LocalExecutor(concurrency=1)

    @property
    def slots(self) -> int:
        return 1

    async def start(self, **options: Any) -> None:
        await self._inner.start(**options)

    async def run(self, spec: EpisodeSpec) -> EpisodeRecord:
        return await self._inner.run(spec)

    def turns_answered(self) -> int:
        return self._inner.turns_answered()

    def describe(self) -> list[str]:
        return []

    async def close(self) -> None:
        await self._inner.close()


def _processes_under(root: Path) -> list[str]:
    """Command lines of live processes that name ``root`` (an agent or verifier left running)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(root) in cmd:
            found.append(cmd)
    return found


@pytest.mark.asyncio
async def test_groups_complete_with_every_attempt_in_runs_results_directory(tmp_path: Path,
                                                                            sandbox_root: Path) -> None:
    out = tmp_path / "run"
    source = RolloutSource(
        TASKS[:2], policy=TokenOracle(), episode=EpisodeConfig("tiny-agent", sandbox="local"),
        run=RunConfig(concurrency=3, attempts=2, out=out, stats="null"),
    )
    groups = [g async for g in source.groups()]
    assert sorted(g.task for g in groups) == sorted(t.name for t in TASKS[:2])
    for g in groups:
        assert g.epoch == 0 and [m.attempt for m in g.members] == [0, 1] and g.rewards == [1.0, 1.0]
        for m in g.members:
            assert m.exit_reason == "completed" and m.samples and m.trained_tokens == 6
            assert m.samples[0].metadata["policy_versions"] == [[2, 5, None], [7, 10, None]]
            assert not m.all_stale and m.stale_tokens == 0
    # A finite source finishes by itself: results.json and episodes.jsonl as run writes them.
    assert source.closed is False and source.summary.planned == 4
    doc = json.loads((out / "results.json").read_text())
    assert doc["summary"]["finished"] == 4 and doc["summary"]["pass@2"] == 1.0 and doc["run"][
        "source"] == "stream"
    assert len((out / "episodes.jsonl").read_text().splitlines()) == 4
    assert len(list((out / "trajectories").iterdir())) == 4
    await source.close()
    with pytest.raises(SourceClosedError, match="closed"):
        await source.next_group()
    assert left_behind(sandbox_root) == []


@pytest.mark.asyncio
async def test_a_slow_consumer_holds_launches_back(tmp_path: Path, sandbox_root: Path) -> None:
    executor = CountingExecutor(concurrency=1)
    bound = 1 + 1  # concurrency + max_buffered
    peak = 0
    async with RolloutSource(
        TASKS[:3], policy=TokenOracle(), max_buffered=1, episode=EpisodeConfig("tiny-agent", sandbox="local"),
        run=RunConfig(concurrency=1, executor=executor, stats="null"),
    ) as source:
        # Nothing is taken: the running episodes finish into the buffer and then nothing more starts.
        for _ in range(300):
            await asyncio.sleep(0.1)
            peak = max(peak, executor.launched)
            if source.buffered == bound:
                break
        await asyncio.sleep(1.0)
        assert executor.launched == bound and source.buffered == bound and source.running == 0
        consumed = 0
        async for episode in source:
            consumed += 1
            assert episode.reward == 1.0
            await asyncio.sleep(0.3)  # a slow trainer step
            peak = max(peak, executor.launched - consumed)
            assert executor.launched - consumed <= bound
    assert consumed == 3 and executor.launched == consumed and peak <= bound
    assert left_behind(sandbox_root) == []


@pytest.mark.asyncio
async def test_a_group_larger_than_concurrency_completes_at_the_tightest_bound(sandbox_root: Path) -> None:
    # concurrency 1 + max_buffered 2 holds exactly one group of 3: its members wait in the buffer while
    # the next one runs, and nothing of the next group starts before this one is taken.
    executor = CountingExecutor(concurrency=1)
    async with RolloutSource(
        TASKS[:1], policy=TokenOracle(), max_buffered=2, epochs=2,
        episode=EpisodeConfig("tiny-agent", sandbox="local"),
        run=RunConfig(concurrency=1, attempts=3, executor=executor, stats="null"),
    ) as source:
        first = await source.next_group()
        assert first is not None and [m.attempt for m in first.members] == [0, 1, 2]
        assert executor.launched == 3  # the second epoch waited for the first group to be taken
        second = await source.next_group()
        assert second is not None and second.epoch == 1 and [m.attempt for m in second.members] == [3, 4, 5]
        assert await source.next_group() is None
    assert first.rewards == second.rewards == [1.0] * 3 and left_behind(sandbox_root) == []


@pytest.mark.asyncio
async def test_close_mid_run_cancels_cleans_up_and_writes_results(tmp_path: Path, sandbox_root: Path) -> None:
    out = tmp_path / "run"
    source = RolloutSource(
        TASKS, policy=TokenOracle(delay=0.3), epochs=None,
        episode=EpisodeConfig("tiny-agent", sandbox="local"),
        run=RunConfig(concurrency=2, out=out, stats="null"),
    )
    first = await source.next_episode()
    assert first is not None and first.reward == 1.0
    await asyncio.sleep(0.2)
    assert source.running == 2  # an endless source keeps its slots full
    # Closed from another task while the consumer waits: the wait ends with the stream.
    waiting = asyncio.create_task(source.next_episode())
    await asyncio.sleep(0)
    await source.close()
    item = await asyncio.wait_for(waiting, 10)
    assert item is None or item.reward == 1.0  # None, or an episode that had finished before the close
    doc = json.loads((out / "results.json").read_text())
    assert doc["summary"]["interrupted"] is True and len(doc["summary"]["cancelled"]) >= 1
    assert doc["summary"]["finished"] == len(source.summary.episodes) >= 1
    assert left_behind(sandbox_root) == [] and _processes_under(sandbox_root) == []
    with pytest.raises(SourceClosedError):
        await source.next_episode()
    with pytest.raises(SourceClosedError):
        await source.pause_sampling()
    with pytest.raises(SourceClosedError):
        await source.start()
    await source.close()  # again: nothing to do


@pytest.mark.asyncio
async def test_a_fence_mid_stream_gives_two_versions_and_staleness_masks_the_old(sandbox_root: Path) -> None:
    policy = TokenOracle(delay=0.5)
    async with Gateway(port=0, side_call_detector=harness_side_call_detector(TinyAgentHarness)) as gw:
        gw.set_policy_version(0)
        async with RolloutSource(
            TASKS[:2], policy=policy, gateway=gw, max_staleness=0,
            episode=EpisodeConfig("tiny-agent", sandbox="local"), run=RunConfig(concurrency=2, stats="null"),
        ) as source:
            await asyncio.wait_for(policy.two_answered.wait(), 60)  # both first turns answered, version 0
            # Abort: a second turn in flight is sampled again after the resume, with version 1.
            async with source.weight_update(1, mode="abort", timeout=30):
                await asyncio.sleep(0.3)
            assert source.policy_version == 1
            first = await source.next_episode()
            await source.set_policy_version(5)
            second = await source.next_episode()
            assert await source.next_episode() is None
    assert first is not None and second is not None
    for ep in (first, second):
        assert (ep.first_version, ep.last_version) == (0, 1) and ep.reward == 1.0
        (sample,) = ep.samples
        assert sample.metadata["turn_ids"] == [1, 2]
    # Handed out at version 1 with max_staleness 0: the version-0 turn is masked, the version-1 one trained.
    (s1,) = first.samples
    assert first.policy_version == 1 and first.stale_tokens == 3 and not first.all_stale
    assert s1.metadata["stale_spans"] == [[2, 5, 0]] and s1.metadata["policy_versions"] == [[7, 10, 1]]
    assert s1.loss_mask.tolist() == [0, 0, 0, 0, 0, 1, 1, 1] and s1.metadata["mixed_versions"] is False
    # Handed out at version 5: nothing is fresh enough.
    assert second.policy_version == 5 and second.all_stale and second.trained_tokens == 0
    assert second.stale_tokens == 6
    assert left_behind(sandbox_root) == []


def test_the_blocking_wrapper_from_plain_threads(tmp_path: Path, sandbox_root: Path) -> None:
    out = tmp_path / "run"
    got: list[Any] = []
    errors: list[BaseException] = []
    source = BlockingRolloutSource(
        TASKS[:2], policy=TokenOracle(), episode=EpisodeConfig("tiny-agent", sandbox="local"),
        run=RunConfig(concurrency=2, attempts=2, out=out, stats="null"),
    )

    def trainer() -> None:
        try:
            for step, group in enumerate(source.groups(), start=1):
                got.append(group)
                with source.weight_update(step):
                    pass
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=trainer)
    t.start()
    t.join(120)
    assert not t.is_alive() and errors == []
    assert len(got) == 2 and all(g.rewards == [1.0, 1.0] for g in got)
    assert source.policy_version == 2
    with pytest.raises(RolloutSourceError, match="episodes or groups"):
        source.next_episode()
    closer = threading.Thread(target=source.close)
    closer.start()
    closer.join(60)
    assert not closer.is_alive()
    source.close()  # again, from this thread
    with pytest.raises(SourceClosedError):
        source.next_group()
    assert json.loads((out / "results.json").read_text())["summary"]["finished"] == 4
    assert left_behind(sandbox_root) == []


def test_a_blocking_take_times_out_without_losing_anything(sandbox_root: Path) -> None:
    with BlockingRolloutSource(
        TASKS[:1], policy=TokenOracle(delay=2.0), episode=EpisodeConfig("tiny-agent", sandbox="local"),
        run=RunConfig(stats="null"),
    ) as source:
        with pytest.raises(TimeoutError, match=r"within 0\.2 s"):
            source.next_episode(timeout=0.2)
        episode = source.next_episode(timeout=60)
        assert episode is not None and episode.reward == 1.0
        assert source.next_episode(timeout=60) is None
    assert left_behind(sandbox_root) == []


@pytest.mark.parametrize(("options", "match"), [
    ({"max_staleness": -1}, "max_staleness must be a non-negative integer"),
    ({"max_staleness": True}, "max_staleness must be a non-negative integer"),
    ({"max_staleness": "2"}, "max_staleness must be a non-negative integer"),
    ({"concurrency": 0}, "concurrency must be an integer of at least 1"),
    ({"attempts": 0}, "attempts must be an integer of at least 1"),
    ({"epochs": 0}, "epochs must be an integer of at least 1 or None"),
    ({"max_buffered": -1}, "max_buffered must be an integer of at least 0"),
    ({"attempts": 8, "concurrency": 2, "max_buffered": 1}, "could never complete a group"),
    ({"executor": LocalExecutor(), "gateway": object()}, "not both"),
])
def test_bad_parameters_are_clear_errors(options: dict[str, Any], match: str) -> None:
    options = dict(options)
    run = {k: options.pop(k) for k in ("concurrency", "attempts", "executor") if k in options}
    with pytest.raises(ValueError, match=match):
        RolloutSource(TASKS, policy=TokenOracle(), episode=EpisodeConfig("tiny-agent"), run=RunConfig(**run),
                      **options)


def test_no_tasks_or_a_task_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="tasks is empty"):
        RolloutSource([], policy=TokenOracle(), episode=EpisodeConfig("tiny-agent"))
    with pytest.raises(ValueError, match="given more than once"):
        RolloutSource([TASKS[0], TASKS[0]], policy=TokenOracle(), episode=EpisodeConfig("tiny-agent"))


@pytest.mark.asyncio
async def test_an_executor_without_a_fence_says_so_and_an_unstarted_source_writes_nothing(
    tmp_path: Path) -> None:
    source = RolloutSource(
        TASKS[:1], policy=TokenOracle(), episode=EpisodeConfig("tiny-agent"),
        run=RunConfig(executor=NoFenceExecutor(), out=tmp_path / "never"),
    )
    with pytest.raises(NoFenceError, match="bare executor has no weight-update fence"):
        await source.pause_sampling()
    assert source.summary.episodes == [] and source.summary.planned == 1
    await source.close()
    assert not (tmp_path / "never").exists()
    with pytest.raises(SourceClosedError):
        await source.next_episode()


@pytest.mark.asyncio
async def test_play_episodes_masks_stale_main_samples(sandbox_root: Path) -> None:
    from ares_gateway.trainers import play_episodes

    async with Gateway(port=0, side_call_detector=harness_side_call_detector(TinyAgentHarness)) as gw:
        gw.set_policy_version(2)
        executor = LocalExecutor(concurrency=1, gateway=gw)
        # At the executor's own version (2) nothing is stale; the trainer at version 3 with bound 0: all is.
        (fresh,) = await play_episodes(
            TASKS[:1], policy=TokenOracle(), max_staleness=0,
            episode=EpisodeConfig("tiny-agent", sandbox="local"), run=RunConfig(executor=executor),
        )
        (old,) = await play_episodes(
            TASKS[:1], policy=TokenOracle(), max_staleness=0, policy_version=3,
            episode=EpisodeConfig("tiny-agent", sandbox="local"), run=RunConfig(executor=executor),
        )
    assert fresh.reward == old.reward == 1.0
    assert fresh.stale_tokens == 0 and int(fresh.sample.loss_mask.sum()) == 6
    assert old.stale_tokens == 6 and int(old.sample.loss_mask.sum()) == 0
    assert old.sample.metadata["stale_spans"] == [[2, 5, 2], [7, 10, 2]]
    with pytest.raises(ValueError, match="max_staleness must be a non-negative integer"):
        await play_episodes(
            TASKS[:1], policy=TokenOracle(), max_staleness=-1,
            episode=EpisodeConfig("tiny-agent", sandbox="local"),
        )
    assert left_behind(sandbox_root) == []
