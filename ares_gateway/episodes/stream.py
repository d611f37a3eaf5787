"""A streaming rollout source: episodes handed to the trainer as they finish, one by one or as GRPO groups.

:class:`RolloutSource` runs episodes as :func:`~ares_gateway.episodes.rollouts.run_rollouts` does (the
same scheduler, executors, driver and OUT directory, written by the same
:class:`~ares_gateway.episodes.rollouts.RunWriter`) but hands each finished one to the consumer while
the others go on, so a trainer trains on the first episodes while the next ones run::

    async with RolloutSource(tasks, policy=policy, episode=EpisodeConfig("mini-swe-agent", sandbox="local"),
                             run=RunConfig(concurrency=8, attempts=4, out="runs/x"),
                             epochs=None, max_staleness=2) as source:
        async for group in source.groups():            # all 4 attempts of one task, as soon as they are done
            loss = train_on(group)                       # group.members[i].samples, .reward, versions
            async with source.weight_update(step):       # no turn is sampled while the weights change
                load_new_weights(step)

**Tasks.** A finite list, run ``epochs`` times (``None``: again and again until :meth:`RolloutSource.close`);
each task ``attempts`` times per epoch, its attempts launched together so its group completes early.
Attempt numbers go on across epochs (epoch ``e``'s are ``e * attempts`` to ``e * attempts + attempts - 1``),
so every episode has its own files in OUT.

**Items.** :meth:`RolloutSource.episodes` (also ``async for episode in source``) gives each finished
episode, an :class:`~ares_gateway.episodes.driver.EpisodeRecord`, in the order they finish;
:meth:`RolloutSource.groups` gives each complete group (all ``attempts`` of one task in one epoch), a
:class:`RolloutGroup`, in the order they complete. A source gives one kind or the other. An episode
that failed (the policy raised, the sandbox did not start) is an item too, with reward 0 and its error,
as in ``run``'s results.

**Back-pressure.** At most ``concurrency`` episodes run at once, and at most ``concurrency +
max_buffered`` are launched and not yet handed to the consumer (a group's members count until the group
is handed out): when the consumer lags, the running episodes finish into the buffer and nothing new is
launched until it takes some.

**Closing.** :meth:`RolloutSource.close` (or leaving ``async with``) launches nothing more, cancels the
running episodes (each removes its sandbox), writes ``results.json`` and closes the executor (its
gateways). A finite source writes ``results.json`` by itself once its last episode is done, and keeps its
executor until :meth:`~RolloutSource.close`, so a last weight update still has gateways to fence: close
it in any case. Every finished episode is in OUT whether or not it was handed out; the ones still
buffered at the close are not handed out afterwards.

**Weight updates.** :meth:`RolloutSource.weight_update` (``pause_sampling`` / ``resume_sampling`` /
``set_policy_version``) fence the executor's gateways (docs/training.md): every running episode's
requests wait while the weights change, and the episodes go on afterwards, each turn keeping the version
that sampled it.

**Staleness.** With ``max_staleness=K``, a trained response whose version is older than ``current - K``
(``current``: the source's policy version when the item is handed out) is masked, not trained
(:func:`trajectory.mask_stale`): ``stale_tokens`` on the item and in each sample's metadata, and
``all_stale`` on an item none of whose trained tokens is left (a trainer skips it). The files in OUT
keep the samples as recorded.

:class:`BlockingRolloutSource` is the same for a trainer with a synchronous loop: the source's event
loop runs in a thread of its own, and every method may be called from any other thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ares_gateway.core.fence import PauseReport
from ares_gateway.episodes.config import EpisodeConfig, RunConfig, check_count, configs_from
from ares_gateway.episodes.driver import EpisodeRecord, EpisodeSpec, renamed_names
from ares_gateway.episodes.executor import Executor, LocalExecutor, start_executor
from ares_gateway.episodes.output import RunSummary
from ares_gateway.episodes.rollouts import RunWriter
from ares_gateway.episodes.scheduler import ScheduleState, schedule
from ares_gateway.episodes.tasks import Task
from ares_gateway.episodes.workspaces import workspace_file
from ares_gateway.gateway import Gateway
from ares_gateway.policies.base import Policy
from trajectory import Sample, check_max_staleness, mask_stale

__all__ = [
    "BlockingRolloutSource",
    "NoFenceError",
    "RolloutGroup",
    "RolloutSource",
    "RolloutSourceError",
    "SourceClosedError",
]

T = TypeVar("T")


__getattr__ = renamed_names(__name__)


class RolloutSourceError(Exception):
    """Base class of the rollout source's errors (bad parameters are ``ValueError``s)."""


class SourceClosedError(RolloutSourceError, RuntimeError):
    """The source was closed: it hands nothing out and fences nothing any more; make a new one."""


class NoFenceError(RolloutSourceError, RuntimeError):
    """The source's executor has no weight-update fence (no ``pause_sampling`` and no gateway of its own)."""


@dataclass
class RolloutGroup:
    """All ``attempts`` episodes of one task in one epoch (a GRPO group), ordered by attempt."""

    task: str
    epoch: int
    members: list[EpisodeRecord]

    @property
    def rewards(self) -> list[float]:
        return [m.reward for m in self.members]

    @property
    def stale_tokens(self) -> int:
        return sum(m.stale_tokens for m in self.members)

    @property
    def infra_errors(self) -> int:
        """Members that failed by the infrastructure on every try (``EpisodeRecord.infra_error``)."""
        return sum(1 for m in self.members if m.infra_error)

    @property
    def all_stale(self) -> bool:
        """Its members had trained tokens and every one was stale."""
        return self.stale_tokens > 0 and all(m.trained_tokens == 0 for m in self.members)


class RolloutSource:
    """Episodes of ``tasks`` streamed to the consumer as they finish (see the module docstring).

    Args:
        tasks: the tasks (a finite list; task names must differ: repeat one with ``run.attempts`` or
            ``epochs``).
        policy, episode, run, console, gateway, run_info: as :func:`~ares_gateway.episodes.rollouts.
            run_rollouts` (an ``infra_error`` episode is in its group; the trainer excludes it).
            ``run.attempts`` is the episodes of each task per epoch (a group); ``run.warm`` is not
            supported (a stream's episodes are not planned ahead).
        epochs: passes over ``tasks``; ``None``: until :meth:`close`.
        max_buffered: finished episodes that may wait for the consumer beyond those running (default:
            the larger of ``run.concurrency`` and ``run.attempts``); ``run.concurrency + max_buffered``
            must hold a group.
        max_staleness: trained responses more than this many versions behind the source's policy version
            when handed out are masked (``None``: no bound).
        settings: the fields of :class:`~ares_gateway.episodes.config.EpisodeConfig` and
            :class:`~ares_gateway.episodes.config.RunConfig` as keyword arguments, deprecated.
    """

    def __init__(
        self,
        tasks: Iterable[Task],
        *,
        policy: Policy,
        episode: EpisodeConfig | None = None,
        run: RunConfig | None = None,
        epochs: int | None = 1,
        max_buffered: int | None = None,
        max_staleness: int | None = None,
        console: Any = None,
        gateway: Gateway | None = None,
        run_info: Mapping[str, Any] | None = None,
        **settings: Any,
    ) -> None:
        episode, run = configs_from("RolloutSource", episode, run, settings)
        run = run.resolved(save_workspaces=True, stats="tensorboard")
        if run.warm:
            raise ValueError("RolloutSource does not set episodes up ahead (its episodes are not planned): "
                             "leave RunConfig's warm 0")
        concurrency, attempts = run.concurrency, run.attempts
        self.retries, self.retry_backoff = run.retries, run.retry_backoff
        self.tasks = list(tasks)
        if not self.tasks:
            raise ValueError("tasks is empty: give the source at least one task")
        names = [t.name for t in self.tasks]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"task(s) {', '.join(twice)} given more than once: run a task more often with "
                             "attempts= (a group) or epochs=, so each episode keeps its own attempt number")
        check_count("epochs", epochs, allow_none=True)
        check_count("max_buffered", max_buffered, allow_none=True, minimum=0)
        self.max_staleness = check_max_staleness(max_staleness)
        self.max_buffered = max(concurrency, attempts) if max_buffered is None else max_buffered
        if concurrency + self.max_buffered < attempts:
            raise ValueError(
                f"concurrency ({concurrency}) + max_buffered ({self.max_buffered}) must be at least "
                f"attempts ({attempts}): fewer episodes in hand than a group holds could never "
                "complete a group")
        if run.executor is not None and gateway is not None:
            raise ValueError("pass gateway= or executor=, not both (an executor brings its own gateways)")
        self.episode = episode
        self.policy = policy
        self.concurrency = concurrency
        self.attempts = attempts
        self.epochs = epochs
        self.executor: Executor = (run.executor if run.executor is not None
                                   else LocalExecutor(concurrency=concurrency, gateway=gateway))
        keep = Path(os.path.abspath(run.out)) if run.out is not None and run.save_workspaces else None
        self._spec: Callable[[Task, int], EpisodeSpec] = lambda task, attempt: EpisodeSpec(
            task, attempt, episode,
            workspace=str(keep / workspace_file(task.name, attempt)) if keep is not None else None)
        settings_row = {
            "harness": episode.harness, "sandbox": episode.sandbox, "concurrency": concurrency,
            "attempts": attempts, "step_limit": episode.step_limit, "time_limit": episode.time_limit,
            "tasks": names, "policy": type(policy).__name__, "executor": self.executor.kind,
            "source": "stream",
            "epochs": epochs, "retries": run.retries, "max_buffered": self.max_buffered,
            "max_staleness": self.max_staleness, "save_workspaces": keep is not None, "image": episode.image,
            **dict(run_info or {}),
        }
        planned = len(self.tasks) * attempts * epochs if epochs is not None else 0
        # The OUT directory, the stats writer and the clock start with the source, not before.
        self._new_writer: Callable[[], RunWriter] = lambda: RunWriter(
            self.executor, settings_row, out=run.out, planned=planned, attempts=attempts,
            success_threshold=run.success_threshold, stats=run.stats or "null", stats_period=run.stats_period,
            console=console, title=f"{episode.harness}: {len(self.tasks)} task(s), streamed")
        self._writer: RunWriter | None = None
        self._empty = RunSummary(episodes=[], planned=planned, attempts=attempts,
                                 success_threshold=run.success_threshold)
        self._tick = 0.5 if console is not None else None
        self._state = ScheduleState()
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()  # the consumer took something: launch again
        self._changed = asyncio.Event()  # an episode finished, or the run ended
        self._ready: deque[EpisodeRecord] = deque()
        self._mode: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None
        self._done = False
        self._closing = False
        self._version: int | None = None
        self._executor_closed = False
        #: Episodes running now (as the scheduler last said).
        self.running = 0
        #: Items handed to the consumer so far (episodes, or groups).
        self.handed_out = 0

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start the executor and begin launching episodes (the first take, or ``async with``, does it)."""
        if self._closing:
            raise SourceClosedError("the rollout source is closed: make a new one")
        if self._task is not None:
            return
        self._writer = writer = self._new_writer()
        try:
            await start_executor(self.executor, tasks=self.tasks, policy=self.policy, episode=self.episode)
        except BaseException:
            self._closing = self._done = True
            writer.finish(self._state)
            await self.executor.close()
            raise
        writer.started()
        self._task = asyncio.create_task(self._drive(), name="ares-rollout-source")

    async def close(self) -> None:
        """Launch nothing more, cancel the running episodes (each removes its sandbox), write
        ``results.json`` and close the executor. Safe to call more than once."""
        self._closing = True
        self._stop.set()
        self._changed.set()
        if self._task is not None:
            await asyncio.shield(self._task)
        self._ready.clear()
        if self._task is not None and not self._executor_closed:
            self._executor_closed = True
            await self.executor.close()

    async def __aenter__(self) -> RolloutSource:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def closed(self) -> bool:
        return self._closing

    @property
    def summary(self) -> RunSummary:
        """What ran so far (complete once the source is closed or finished; empty before it starts)."""
        return self._writer.summary if self._writer is not None else self._empty

    @property
    def buffered(self) -> int:
        """Finished episodes not yet handed out (a group's members until the group is)."""
        return len(self._ready)

    def _plan(self) -> Iterable[EpisodeSpec]:
        def epoch(e: int) -> Iterator[EpisodeSpec]:
            for task in self.tasks:
                for a in range(self.attempts):
                    yield self._spec(task, e * self.attempts + a)

        if self.epochs is not None:
            return [spec for e in range(self.epochs) for spec in epoch(e)]

        def endless() -> Iterator[EpisodeSpec]:
            e = 0
            while True:
                yield from epoch(e)
                e += 1

        return endless()

    def _may_launch(self, running: int) -> bool:
        return running + len(self._ready) < self.concurrency + self.max_buffered

    def _on_tick(self, running: int) -> None:
        self.running = running
        assert self._writer is not None
        self._writer.refresh(running)

    def _on_record(self, rec: EpisodeRecord) -> None:
        assert self._writer is not None
        self._writer.record(rec)
        if not self._closing:
            self._ready.append(rec)
        self._changed.set()

    async def _drive(self) -> None:
        try:
            await schedule(self._plan(), self.executor, concurrency=self.concurrency, stop=self._stop,
                           on_record=self._on_record, on_tick=self._on_tick, tick=self._tick,
                           state=self._state, may_launch=self._may_launch, wake=self._wake,
                           retries=self.retries, retry_backoff=self.retry_backoff)
        except Exception as exc:  # the executor failed as a whole: the consumer gets it
            self._failure = exc
        finally:
            self.running = 0
            assert self._writer is not None
            summary = self._writer.summary
            if self.epochs is None:
                summary.planned = len(summary.episodes) + len(self._state.cancelled)
            try:
                # results.json as soon as the run is over; the executor stays up until close(), so a
                # trainer's last weight update still has its gateways to fence.
                self._writer.finish(self._state)
            finally:
                self._done = True
                self._changed.set()

    # ------------------------------------------------------------------ taking

    def _hand(self, rec: EpisodeRecord, current: int | None) -> EpisodeRecord:
        samples: list[Sample] = list(rec.samples)
        before = sum(int(s.loss_mask.sum()) for s in samples)
        stale = 0
        if self.max_staleness is not None:
            samples = [mask_stale(s, current, self.max_staleness) for s in samples]
            stale = sum(int(s.metadata["stale_tokens"]) for s in samples)
        # The turn log and the agent's logs are in OUT already: the consumer may hold what it takes.
        return EpisodeRecord(rec.result, samples, policy_version=current, stale_tokens=stale,
                             all_stale=before > 0 and stale == before)

    def _pop(self, mode: str) -> EpisodeRecord | RolloutGroup | None:
        if not self._ready:
            return None
        current = self.policy_version
        if mode == "episodes":
            return self._hand(self._ready.popleft(), current)
        counts: dict[tuple[str, int], int] = {}
        for rec in self._ready:
            key = (rec.result.task, rec.result.attempt // self.attempts)
            counts[key] = counts.get(key, 0) + 1
            if counts[key] == self.attempts:
                break
        else:
            return None
        members = [r for r in self._ready if (r.result.task, r.result.attempt // self.attempts) == key]
        self._ready = deque(r for r in self._ready
                            if (r.result.task, r.result.attempt // self.attempts) != key)
        members.sort(key=lambda r: r.result.attempt)
        return RolloutGroup(key[0], key[1], [self._hand(r, current) for r in members])

    async def _take(self, mode: str) -> Any:
        if self._closing:
            raise SourceClosedError("the rollout source is closed: nothing more is handed out")
        if self._mode is None:
            self._mode = mode
        elif self._mode != mode:
            raise RolloutSourceError(
                f"this source hands out {self._mode}; a source gives episodes or groups, "
                "not both (make one source per kind)")
        await self.start()
        while True:
            item = self._pop(mode)
            if item is not None:
                self.handed_out += 1
                self._wake.set()
                return item
            if self._failure is not None:
                raise self._failure
            if self._done or self._closing:
                return None
            self._changed.clear()
            await self._changed.wait()

    async def next_episode(self) -> EpisodeRecord | None:
        """The next finished episode; ``None`` once the source has ended (a finite one ran out, or it was
        closed while waiting). Raises :class:`SourceClosedError` after :meth:`close`."""
        item: EpisodeRecord | None = await self._take("episodes")
        return item

    async def next_group(self) -> RolloutGroup | None:
        """The next complete group; ``None`` once the source has ended (as :meth:`next_episode`)."""
        item: RolloutGroup | None = await self._take("groups")
        return item

    async def episodes(self) -> AsyncIterator[EpisodeRecord]:
        """Each finished episode, in the order they finish."""
        while (item := await self.next_episode()) is not None:
            yield item

    async def groups(self) -> AsyncIterator[RolloutGroup]:
        """Each complete group (all ``attempts`` of one task in one epoch), in the order they complete."""
        while (item := await self.next_group()) is not None:
            yield item

    def __aiter__(self) -> AsyncIterator[EpisodeRecord]:
        return self.episodes()

    # ------------------------------------------------------------------ weight updates

    @property
    def policy_version(self) -> int | None:
        """The version of the weights the policy samples with now: the executor's (its gateways'), else
        the last one set through this source; staleness is judged against it."""
        ex: Any = self.executor
        known = ex.policy_version if hasattr(ex, "policy_version") else None
        gw = getattr(ex, "gateway", None)
        if known is None and gw is not None:
            known = gw.policy_version
        versions = [v for v in (known, self._version) if v is not None]
        return max(versions) if versions else None

    def _fence(self, name: str) -> Callable[..., Any]:
        if self._closing:
            raise SourceClosedError(f"the rollout source is closed: {name} has nothing to fence")
        ex: Any = self.executor
        if hasattr(ex, name):
            method: Callable[..., Any] = getattr(ex, name)
            return method
        gw = getattr(ex, "gateway", None)
        if gw is not None and hasattr(gw, name):
            gw_method: Callable[..., Any] = getattr(gw, name)
            return gw_method
        raise NoFenceError(f"the {ex.kind} executor has no weight-update fence ({name}) "
                           + ("yet: start the source first" if hasattr(ex, "gateway") else
                              "and no gateway of its own: fence its gateways yourself"))

    async def set_policy_version(self, version: int) -> None:
        """Set the version on the executor's gateways (as ``Gateway.set_policy_version``)."""
        await _settle(self._fence("set_policy_version")(version))
        self._version = version

    async def pause_sampling(self, mode: str = "drain", *, timeout: float | None = None) -> PauseReport:
        """Pause sampling on the executor's gateways (as ``Gateway.pause_sampling``)."""
        report: PauseReport = await _settle(self._fence("pause_sampling")(mode, timeout=timeout))
        return report

    async def resume_sampling(self, version: int | None = None) -> float:
        """Resume sampling, with ``version`` now loaded (as ``Gateway.resume_sampling``); the pause's
        seconds."""
        paused: float = await _settle(self._fence("resume_sampling")(version))
        if version is not None:
            self._version = version
        return paused

    @contextlib.asynccontextmanager
    async def weight_update(self, version: int | None = None, *, mode: str = "drain",
                            timeout: float | None = None) -> AsyncIterator[PauseReport]:
        """``async with source.weight_update(step):`` pause, update the weights in the body, resume with
        ``version``; resumed without it when the body raises (as ``Gateway.weight_update``)."""
        report = await self.pause_sampling(mode, timeout=timeout)
        try:
            yield report
        except BaseException:
            await self.resume_sampling(None)
            raise
        await self.resume_sampling(version)


async def _settle(value: Any) -> Any:
    """A method's result: awaited when it is awaitable (an executor's fence is async, a gateway's resume
    not)."""
    return await value if inspect.isawaitable(value) else value


async def _within(take: Callable[[], Coroutine[Any, Any, T]], timeout: float | None) -> T:
    """``take()`` given ``timeout`` seconds, on the source's loop: an item taken as the time runs out is
    returned, not lost (a take is cancelled only while it waits, before it has taken anything)."""
    try:
        return await asyncio.wait_for(take(), timeout)
    except TimeoutError:
        raise TimeoutError(f"nothing came from the rollout source within {timeout} s") from None


class BlockingRolloutSource:
    """A :class:`RolloutSource` for a trainer with a synchronous loop: the source's event loop runs in a
    thread of its own; every method may be called from any other thread (not from an in-process policy
    running on that loop). Takes :class:`RolloutSource`'s arguments and starts at once::

        with BlockingRolloutSource(tasks, harness="tiny-agent", policy=policy, attempts=4) as source:
            for group in source.groups():
                train(group)
                with source.weight_update(step):
                    load_weights(step)

    ``timeout`` on a take: seconds to wait for an item (``TimeoutError`` after them; nothing is lost).
    """

    def __init__(self, tasks: Iterable[Task], **options: Any) -> None:
        self.source = RolloutSource(tasks, **options)  # bad arguments raise here, in the caller's thread
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ares-rollout-source",
                                        daemon=True)
        self._thread.start()
        self._closed = False
        self._close_lock = threading.Lock()
        try:
            self._call(self.source.start())
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError(
                "BlockingRolloutSource called from its own event loop's thread: use its .source "
                "(a RolloutSource) with await there")
        if self._loop.is_closed():
            coro.close()
            raise SourceClosedError("the rollout source is closed: make a new one")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _stop_loop(self) -> None:
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def next_episode(self, timeout: float | None = None) -> EpisodeRecord | None:
        """The next finished episode, ``None`` once the source has ended
        (:meth:`RolloutSource.next_episode`)."""
        return self._call(_within(self.source.next_episode, timeout))

    def next_group(self, timeout: float | None = None) -> RolloutGroup | None:
        """The next complete group, ``None`` once the source has ended (:meth:`RolloutSource.next_group`)."""
        return self._call(_within(self.source.next_group, timeout))

    def __iter__(self) -> Iterator[EpisodeRecord]:
        while (item := self.next_episode()) is not None:
            yield item

    def episodes(self) -> Iterator[EpisodeRecord]:
        return iter(self)

    def groups(self) -> Iterator[RolloutGroup]:
        while (item := self.next_group()) is not None:
            yield item

    @property
    def policy_version(self) -> int | None:
        return self.source.policy_version

    @property
    def summary(self) -> RunSummary:
        return self.source.summary

    def set_policy_version(self, version: int) -> None:
        self._call(self.source.set_policy_version(version))

    def pause_sampling(self, mode: str = "drain", *, timeout: float | None = None) -> PauseReport:
        return self._call(self.source.pause_sampling(mode, timeout=timeout))

    def resume_sampling(self, version: int | None = None) -> float:
        return self._call(self.source.resume_sampling(version))

    @contextlib.contextmanager
    def weight_update(self, version: int | None = None, *, mode: str = "drain",
                      timeout: float | None = None) -> Iterator[PauseReport]:
        """``with source.weight_update(step):`` as :meth:`RolloutSource.weight_update`."""
        report = self.pause_sampling(mode, timeout=timeout)
        try:
            yield report
        except BaseException:
            self.resume_sampling(None)
            raise
        self.resume_sampling(version)

    def close(self) -> None:
        """Close the source (:meth:`RolloutSource.close`) and stop its thread. Safe to call more than once."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._call(self.source.close())
        finally:
            self._stop_loop()

    def __enter__(self) -> BlockingRolloutSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
