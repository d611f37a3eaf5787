"""Which episode runs when: the plan run on an executor with bounded concurrency, and stopping.

:func:`schedule` keeps at most ``concurrency`` episodes of the plan running on the executor, in plan
order, and hands each finished one to ``on_record``. An episode that failed by the infrastructure (its
sandbox, its install, its verifier's machinery; an executor call that raised) is run again, at most
``retries`` times with backoff, on a fresh sandbox; if every try failed it is recorded as
``infra_error`` (:mod:`~ares_gateway.episodes.failures`) and the run goes on. Setting ``stop`` (the CLI
does on Ctrl-C), or cancelling the caller, launches nothing more and cancels what runs (each episode
removes its sandbox); their keys are in :attr:`ScheduleState.cancelled`.

The plan may be a sequence or a lazy, even endless, iterator (the streaming rollout source's
epochs). ``may_launch(running)`` holds launches back while it is false (the source's back-pressure:
a consumer that lags); ``wake`` is set to have it asked again (the consumer took an item).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Iterable, Sized
from dataclasses import dataclass, field
from typing import Any

from ares_gateway.episodes.driver import EpisodeRecord, EpisodeSpec
from ares_gateway.episodes.episode import one_line
from ares_gateway.episodes.executor import Executor
from ares_gateway.episodes.failures import (
    DEFAULT_RETRIES,
    DEFAULT_RETRY_BACKOFF,
    INFRA_ERROR,
    MAX_RETRY_WAIT,
    check_retries,
    classify,
)
from ares_gateway.episodes.result import EpisodeResult

log = logging.getLogger(__name__)

__all__ = ["ScheduleState", "run_with_retries", "schedule"]


@dataclass
class ScheduleState:
    """What :func:`schedule` leaves behind, also when it is interrupted: the keys (``task.attempt``) of
    episodes cancelled before they finished, and whether the run stopped early."""

    cancelled: list[str] = field(default_factory=list)
    interrupted: bool = False


async def schedule(
    plan: Iterable[EpisodeSpec],
    executor: Executor,
    *,
    concurrency: int,
    stop: asyncio.Event,
    on_record: Callable[[EpisodeRecord], None],
    on_tick: Callable[[int], None] | None = None,
    tick: float | None = None,
    state: ScheduleState | None = None,
    may_launch: Callable[[int], bool] | None = None,
    wake: asyncio.Event | None = None,
    retries: int = DEFAULT_RETRIES,
    retry_backoff: float = DEFAULT_RETRY_BACKOFF,
) -> ScheduleState:
    """Run ``plan`` on ``executor`` (see the module docstring). ``on_tick(running)`` is called whenever
    an episode starts or ends and every ``tick`` seconds (the progress bar). A sized plan's episodes
    never launched before a stop are in :attr:`ScheduleState.cancelled`; an iterator's are not read.
    ``retries`` / ``retry_backoff``: :func:`~ares_gateway.episodes.failures.run_with_retries`."""
    check_retries(retries, retry_backoff)
    state = state if state is not None else ScheduleState()
    width = max(1, min(concurrency, executor.slots))
    specs = iter(plan)
    nxt: list[EpisodeSpec] = []  # the next spec, read ahead to know whether the plan has more

    def more() -> bool:
        if not nxt:
            spec = next(specs, None)
            if spec is None:
                return False
            nxt.append(spec)
        return True

    running: dict[asyncio.Task[Any], EpisodeSpec] = {}
    stop_wait = asyncio.create_task(stop.wait())
    wake_wait: asyncio.Task[Any] | None = None
    try:
        while (running or more()) and not stop.is_set():
            while (len(running) < width and not stop.is_set()
                   and (may_launch is None or may_launch(len(running)))
                   and more()):
                spec = nxt.pop()
                episode = run_with_retries(executor.run, spec, retries=retries, backoff=retry_backoff)
                running[asyncio.create_task(episode, name=f"ares-episode-{spec.key}")] = spec
            if on_tick is not None:
                on_tick(len(running))
            waiting: set[asyncio.Task[Any]] = {*running, stop_wait}
            if wake is not None:
                if wake_wait is None:
                    wake_wait = asyncio.create_task(wake.wait())
                waiting.add(wake_wait)
            done, _ = await asyncio.wait(waiting, timeout=tick, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is stop_wait:
                    continue
                if t is wake_wait:
                    assert wake is not None
                    wake.clear()
                    wake_wait = None
                    continue
                spec = running.pop(t)  # type: ignore[call-overload]
                try:
                    record = t.result()
                except asyncio.CancelledError:
                    state.cancelled.append(spec.key)
                    continue
                except Exception as exc:  # a policy or runner failure: recorded, the run goes on
                    log.warning("episode %s failed: %s: %s", spec.key, type(exc).__name__, one_line(str(exc)))
                    log.debug("the episode's traceback", exc_info=True)
                    record = EpisodeRecord(EpisodeResult(spec.task.name, spec.attempt, 0.0, 0, 0.0, "error",
                                                         error=one_line(f"{type(exc).__name__}: {exc}")))
                on_record(record)
    except asyncio.CancelledError:
        stop.set()
        raise
    finally:
        stop_wait.cancel()
        if wake_wait is not None:
            wake_wait.cancel()
        if running:
            state.interrupted = True
            for t in running:
                t.cancel()
            # Each cancelled episode removes its own sandbox (its driver closes it in a finally).
            results = await asyncio.gather(*running, return_exceptions=True)
            for spec, res in zip(list(running.values()), results, strict=True):
                if isinstance(res, EpisodeRecord):
                    on_record(res)  # it finished while being cancelled
                else:
                    state.cancelled.append(spec.key)
        if stop.is_set():
            # What was never launched: listed for a sized plan (run's), not read from an iterator.
            left = [*nxt, *specs] if isinstance(plan, Sized) else []
            if left:
                state.interrupted = True
                state.cancelled.extend(spec.key for spec in left)
    return state


async def run_with_retries(run: Callable[[EpisodeSpec], Awaitable[EpisodeRecord]], spec: EpisodeSpec, *,
                           retries: int = DEFAULT_RETRIES,
                           backoff: float = DEFAULT_RETRY_BACKOFF) -> EpisodeRecord:
    """``run(spec)`` (an executor's ``run``), tried again while it fails by the infrastructure, at most
    ``retries`` more times, waiting ``backoff`` seconds before the first retry and twice as long before
    each next one (at most :data:`MAX_RETRY_WAIT`). Each try is a new episode: a fresh sandbox and
    session (the driver removed the failed one's). A ``run`` that raises is an ``error`` try.

    Returns the first try that did not fail by the infrastructure (its ``retries`` and
    ``retry_errors`` say what came before), or, when all did, the last one turned into ``infra_error``:
    its samples dropped, its cause in ``infra_cause`` and ``error``. Cancellation is never retried.
    """
    check_retries(retries, backoff)
    errors: list[str] = []
    record: EpisodeRecord
    for attempt in range(retries + 1):
        if attempt:
            wait = min(backoff * 2 ** (attempt - 1), MAX_RETRY_WAIT)
            log.warning(
                "episode %s failed by the infrastructure (%s); retrying in %.1f s with a fresh sandbox "
                "(retry %d of %d)", spec.key, errors[-1], wait, attempt, retries)
            await asyncio.sleep(wait)
        try:
            record = await run(spec)
        except Exception as exc:  # a runner or worker failure: an ``error`` try
            log.debug("the episode's traceback", exc_info=True)
            record = EpisodeRecord(EpisodeResult(spec.task.name, spec.attempt, 0.0, 0, 0.0, "error",
                                                 error=one_line(f"{type(exc).__name__}: {exc}")))
        result = record.result
        if classify(result) != "infra":
            result.retries, result.retry_errors = attempt, errors
            return record
        errors.append(one_line(f"{result.exit_reason}: {result.error or 'no error message'}", 300) or "")
    result = record.result
    cause = result.exit_reason
    tries = retries + 1
    final = dataclasses.replace(
        result, exit_reason=INFRA_ERROR, reward=0.0, samples=0, infra_cause=cause, retries=retries,
        retry_errors=errors[:-1],
        error=one_line(f"{cause} on every one of {tries} tr{'y' if tries == 1 else 'ies'}: "
                       f"{result.error or 'no error message'}"))
    return EpisodeRecord(final, [], record.turns, record.logs)
