"""Which episode runs when: the plan run on an executor with bounded concurrency, and stopping.

:func:`schedule` keeps at most ``concurrency`` episodes of the plan running on the executor, in plan
order, and hands each finished one to ``on_record``. An episode whose executor call raised (a policy
or runner failure) is recorded as an ``error`` episode and the run goes on. Setting ``stop`` (the CLI
does on Ctrl-C), or cancelling the caller, launches nothing more and cancels what runs (each episode
removes its sandbox); their keys are in :attr:`ScheduleState.cancelled`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ares_gateway.episodes.driver import EpisodeRecord, EpisodeSpec
from ares_gateway.episodes.episode import one_line
from ares_gateway.episodes.executor import Executor
from ares_gateway.episodes.output import EpisodeResult

log = logging.getLogger(__name__)

__all__ = ["ScheduleState", "schedule"]


@dataclass
class ScheduleState:
    """What :func:`schedule` leaves behind, also when it is interrupted: the keys (``task.attempt``) of
    episodes cancelled before they finished, and whether the run stopped early."""

    cancelled: list[str] = field(default_factory=list)
    interrupted: bool = False


async def schedule(
    plan: Sequence[EpisodeSpec],
    executor: Executor,
    *,
    concurrency: int,
    stop: asyncio.Event,
    on_record: Callable[[EpisodeRecord], None],
    on_tick: Callable[[int], None] | None = None,
    tick: float | None = None,
    state: ScheduleState | None = None,
) -> ScheduleState:
    """Run ``plan`` on ``executor`` (see the module docstring). ``on_tick(running)`` is called whenever
    an episode starts or ends and every ``tick`` seconds (the progress bar)."""
    state = state if state is not None else ScheduleState()
    width = max(1, min(concurrency, executor.slots))
    pending = list(plan)
    running: dict[asyncio.Task[Any], EpisodeSpec] = {}
    stop_wait = asyncio.create_task(stop.wait())
    try:
        while (pending or running) and not stop.is_set():
            while pending and len(running) < width and not stop.is_set():
                spec = pending.pop(0)
                running[asyncio.create_task(executor.run(spec), name=f"ares-episode-{spec.key}")] = spec
            if on_tick is not None:
                on_tick(len(running))
            done, _ = await asyncio.wait({*running, stop_wait}, timeout=tick, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is stop_wait:
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
        if pending and stop.is_set():
            state.interrupted = True
            state.cancelled.extend(spec.key for spec in pending)
    return state
