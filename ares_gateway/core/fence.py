"""The weight-update fence: pause sampling, wait until no generation is in flight, resume.

A trainer that updates the policy's weights while episodes run must not let a turn be sampled
across the update. :class:`SamplingFence` gives it one call pair (``Gateway.pause_sampling`` /
``Gateway.resume_sampling``, and ``POST /sampling/pause`` / ``/sampling/resume``):

* While paused, the broker hands no request to any policy: ``take``, ``/poll`` and the in-process
  policies' ``next_request`` return nothing, and every agent request stays parked (its agent sees
  only latency; a parked streaming request gets SSE keep-alives).
* ``drain`` (the default) returns once every generation in flight has finished and been answered.
* ``abort`` cancels the in-process generations (run through :meth:`SamplingFence.generate`), which
  sample their request again after the resume; a request leased to a poller (``/poll``) is taken
  back and delivered again after the resume, and its old poller's answer is refused
  (:class:`~ares_gateway.core.errors.FencedAnswerError`, 409). A streamed answer the agent is
  already receiving cannot be taken back: abort waits for it, as drain does.

What counts as in flight: a running in-process generation, a request taken by someone who does not
run it through :meth:`~SamplingFence.generate` (a poller, a ``GatewayEnv`` caller) and not yet
answered or handed back, and a streamed answer still being sent to its agent.

The time a request spends parked in a pause does not count against ``request_timeout``: the
weight update is not the policy failing to answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from ares_gateway.core.errors import (
    DrainTimeoutError,
    InvalidFenceError,
    SamplingNotPausedError,
    SamplingPausedError,
)

if TYPE_CHECKING:
    from ares_gateway.core.broker import Broker, ParkedRequest

T = TypeVar("T")
PauseMode = Literal["drain", "abort"]
PAUSE_MODES: tuple[str, ...] = ("drain", "abort")


def check_pause(mode: object, timeout: object) -> None:
    """Raise :class:`InvalidFenceError` unless ``mode`` is a pause mode and ``timeout`` is ``None`` or a
    positive finite number of seconds (what :meth:`SamplingFence.pause` accepts)."""
    if mode not in PAUSE_MODES:
        raise InvalidFenceError(f"unknown pause mode {mode!r}: use \"drain\" or \"abort\"")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                                or not 0 < timeout < float("inf")):
        raise InvalidFenceError(
            f"timeout must be a positive number of seconds (or null: none), got {timeout!r}")


@dataclass(frozen=True, slots=True)
class PauseReport:
    """What a pause did: its mode, how long the drain took, what was in flight when it began and
    how many generations it aborted (abort mode), and how many requests are parked now."""

    mode: str
    drain_seconds: float
    in_flight: int
    aborted: int
    parked: int

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "drain_seconds": self.drain_seconds, "in_flight": self.in_flight,
                "aborted": self.aborted, "parked": self.parked}


class SamplingFence:
    """The pause state of one gateway's broker (see the module docstring). One per gateway."""

    def __init__(self, broker: Broker, *,
                 on_fence: Callable[[str, dict[str, float]], None] | None = None) -> None:
        self._broker = broker
        #: "sampling", "draining" (a pause waits for the generations in flight) or "paused".
        self.state = "sampling"
        self.mode: str | None = None
        #: Completed pauses, and the seconds spent paused and draining over all of them.
        self.pauses = 0
        self.paused_seconds_total = 0.0
        self.drain_seconds_total = 0.0
        self.last_drain_seconds: float | None = None
        self._paused_at = 0.0
        self._open = asyncio.Event()
        self._open.set()
        self._changed: asyncio.Event | None = None
        #: In-process generations running now: request id -> its task.
        self._running: dict[str, asyncio.Task[Any]] = {}
        #: Ids of the requests whose in-process generation waits for sampling to reopen.
        self._waiting: set[str] = set()
        self._aborted: set[asyncio.Task[Any]] = set()
        #: Called with ("pause" | "resume", scalars) as each completes (the run's stats tracker).
        self.on_fence = on_fence
        self._signal: asyncio.Future[None] | None = None

    def pause_signal(self) -> asyncio.Future[None]:
        """A future resolved when the next pause begins (shared by whoever waits for it: the streaming
        requests, which start their keep-alives then)."""
        signal = self._signal
        if signal is None or signal.done():
            signal = self._signal = asyncio.get_running_loop().create_future()
        return signal

    @property
    def paused(self) -> bool:
        """Whether sampling is stopped (draining or paused)."""
        return self.state != "sampling"

    def in_flight(self) -> int:
        """Generations in flight now (module docstring: what counts)."""
        waiting = self._waiting
        taken = sum(1 for p in self._broker.taken() if p.id not in waiting)
        return taken + self._broker.streams_in_flight

    def snapshot(self) -> dict[str, Any]:
        """The fence's state for ``GET /sampling``."""
        return {
            "state": self.state,
            "mode": self.mode,
            "paused_for": time.monotonic() - self._paused_at if self.paused else 0.0,
            "in_flight": self.in_flight(),
            "parked": self._broker.pending_count,
            "pauses": self.pauses,
            "last_drain_seconds": self.last_drain_seconds,
        }

    async def pause(self, mode: str = "drain", timeout: float | None = None) -> PauseReport:
        """Stop handing requests to policies and return once nothing is in flight.

        Raises :class:`SamplingPausedError` when paused already, :class:`InvalidFenceError` for a bad
        ``mode`` or ``timeout``, and :class:`DrainTimeoutError` when the drain outlasts ``timeout``
        seconds (sampling is then resumed)."""
        check_pause(mode, timeout)
        if self.paused:
            raise SamplingPausedError(
                f"sampling is {self.state} already (mode {self.mode}); resume it before pausing again")
        broker = self._broker
        self.state, self.mode = "draining", mode
        self._paused_at = started = time.monotonic()
        broker.pause()
        self._open.clear()
        if self._signal is not None and not self._signal.done():
            self._signal.set_result(None)
        in_flight = self.in_flight()
        aborted = 0
        if mode == "abort":
            for task in self._running.values():
                if not task.done():
                    self._aborted.add(task)
                    task.cancel()
                    aborted += 1
            aborted += broker.take_back_unowned()
        changed = self._changed = asyncio.Event()
        broker.on_change = changed.set
        try:
            async with asyncio.timeout(timeout):
                while self.in_flight():
                    changed.clear()
                    await changed.wait()
        except TimeoutError:
            left = self.in_flight()
            self._reopen()
            raise DrainTimeoutError(
                f"{left} generation(s) were still in flight after {timeout:g} s; sampling was resumed. "
                "Retry with a longer timeout, or with mode \"abort\"") from None
        except BaseException:
            self._reopen()
            raise
        finally:
            broker.on_change = None
            self._changed = None
        drained = time.monotonic() - started
        self.state = "paused"
        self.last_drain_seconds = drained
        self.drain_seconds_total += drained
        report = PauseReport(mode, drained, in_flight, aborted, broker.pending_count)
        if self.on_fence is not None:
            self.on_fence("pause", {"fence/drain_seconds": drained, "fence/in_flight": float(in_flight),
                                    "fence/aborted": float(aborted)})
        return report

    def resume(self) -> float:
        """Hand requests to policies again; returns the seconds sampling was paused.
        Raises :class:`SamplingNotPausedError` unless a pause has returned."""
        if self.state != "paused":
            raise SamplingNotPausedError(
                "sampling is not paused: pause it first" if self.state == "sampling"
                else "the pause is still draining: resume after pause_sampling returns")
        paused_for = self._reopen()
        self.pauses += 1
        self.paused_seconds_total += paused_for
        if self.on_fence is not None:
            self.on_fence("resume", {"fence/paused_seconds": paused_for})
        return paused_for

    def _reopen(self) -> float:
        paused_for = time.monotonic() - self._paused_at
        self.state, self.mode = "sampling", None
        self._broker.resume()
        self._open.set()
        return paused_for

    async def wait_open(self) -> None:
        """Return when sampling is not paused (at once when it is not)."""
        while self.paused:
            await self._open.wait()

    async def generate(self, parked: ParkedRequest, make: Callable[[], Awaitable[T]]) -> T:
        """Run one in-process generation for ``parked`` (``make()``: the policy's call) inside the fence:
        it starts only while sampling is open, a drain waits for it, and an abort cancels it and runs
        ``make()`` again once sampling resumes. The caller answers the request with the result.

        ``make()`` runs in the calling task, which an abort cancels (the cancellation is taken back
        here); a caller cancelled for its own reasons gets its ``CancelledError``, and the request goes
        back to the parked ones. A policy that swallows the cancellation and answers anyway has its
        answer dropped and is called again."""
        broker = self._broker
        broker.own(parked)
        try:
            while True:
                if self.paused:
                    self._waiting.add(parked.id)
                    self._notify()
                    try:
                        await self.wait_open()
                    finally:
                        self._waiting.discard(parked.id)
                # Handed to the policy now: the turn is stamped with the weights of this attempt (an
                # aborted one is sampled again with the version set at the resume).
                parked.policy_version = broker.policy_version
                # Run in the caller's task (no task of its own per turn): an abort cancels the caller's
                # task and takes the cancellation back here (uncancel), as asyncio.timeout does.
                task = asyncio.current_task()
                assert task is not None
                self._running[parked.id] = task
                try:
                    result = await make()
                except asyncio.CancelledError:
                    if task not in self._aborted:
                        raise  # the caller itself was cancelled
                    self._aborted.discard(task)
                    if task.uncancel() > 0:
                        raise  # cancelled by someone else too
                    continue  # sampled (in part) with the weights being replaced: sample again
                finally:
                    if self._running.get(parked.id) is task:
                        del self._running[parked.id]
                    self._notify()
                if task in self._aborted:  # the policy swallowed the cancellation: its answer is stale
                    self._aborted.discard(task)
                    task.uncancel()
                    continue
                return result
        except asyncio.CancelledError:
            # The caller stopped (a PolicyServer stopping): the request goes back to the parked ones
            # instead of staying taken by nobody.
            broker.hand_back(parked)
            raise

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
