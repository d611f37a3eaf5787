"""Warm sandboxes: episodes set up ahead of their turn, so that an episode starts with its agent's launch.

A :class:`WarmPool` of ``size`` keeps up to that many episodes of the run's plan, in the order they
will run, set up ahead (:meth:`TaskEpisode.prepare <ares_gateway.episodes.episode.TaskEpisode.prepare>`:
the session created, the sandbox started from the task's image, the workdir prepared, the harness's CLI
installed and configured) while earlier episodes run. :meth:`WarmPool.take` hands an episode its own;
the pool then sets up the next one of the plan in the background.

* **Used once.** Each warm sandbox is made for one planned episode and removed with it: nothing an
  agent leaves (a file, a process) reaches another episode. An episode with nothing warm (the pool is
  behind, or a retry, which always gets a fresh sandbox) sets up cold, as without a pool.
* **Bounded.** At most ``size`` set-ups, done or under way, wait ahead of their episodes at once (one
  an episode has taken and waits for no longer counts).
* **Cleaned.** :meth:`WarmPool.close` (the executor's close, which a cancelled run reaches too)
  removes every sandbox not taken and deletes its session; a set-up cut short by the close removes
  what it had started. A process killed outright leaves them to ``ares-gateway gc``, like any sandbox:
  warm sandboxes carry the usual labels and one of their own, ``ares-gateway.warm``.
* **Failures are the episode's.** A set-up that fails ahead (the sandbox does not start, the install
  fails) is handed to its episode as it is, which ends it as the same failure a cold start would have
  (an infrastructure failure: retried on a fresh sandbox).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from ares_gateway.core.sessions import SessionInfo
from ares_gateway.episodes.episode import EpisodeSetupError, TaskEpisode
from ares_gateway.episodes.episode_spec import EpisodeConfig
from ares_gateway.episodes.tasks import Task
from ares_gateway.gateway import Gateway
from harnesses import BaseHarness

log = logging.getLogger(__name__)

__all__ = ["WARM_LABEL", "PlannedEpisode", "WarmPool", "WarmPoolStats", "Warmed", "check_warm"]

#: The label every warm sandbox carries (besides the usual session and harness labels).
WARM_LABEL = "ares-gateway.warm"


class PlannedEpisode(Protocol):
    """What the pool reads of a planned episode (an :class:`ares_gateway.episodes.driver.EpisodeSpec`)."""

    @property
    def task(self) -> Task: ...
    @property
    def attempt(self) -> int: ...
    @property
    def episode(self) -> EpisodeConfig: ...
    @property
    def workspace(self) -> str | None: ...
    @property
    def key(self) -> str: ...
    def new_harness(self) -> BaseHarness: ...


def check_warm(size: int) -> int:
    """``size`` if it is a usable pool size (0: no pool), else a ``ValueError`` that says so."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"warm must be a whole number of sandboxes, 0 or more, got {size!r}")
    return size


@dataclass(frozen=True)
class Warmed:
    """An episode set up ahead for its session: :meth:`TaskEpisode.start` launches its agent."""

    session: SessionInfo
    episode: TaskEpisode


@dataclass(frozen=True)
class WarmPoolStats:
    """What a pool did: set-ups begun, episodes handed a warm one, episodes that found none (cold), and
    set-ups removed unused at close."""

    started: int
    taken: int
    missed: int
    discarded: int


class WarmPool:
    """Up to ``size`` planned episodes set up ahead on ``gateway`` (see the module docstring).

    Args:
        gateway: the started gateway whose sessions the episodes run.
        size: how many set-ups at most, done or under way, wait ahead of their episodes; 0 is no pool.
    """

    def __init__(self, gateway: Gateway, size: int) -> None:
        self.gateway = gateway
        self.size = check_warm(size)
        self._upcoming: deque[PlannedEpisode] = deque()
        self._ready: dict[str, tuple[PlannedEpisode, asyncio.Task[Warmed]]] = {}
        self._taken_keys: set[str] = set()
        self._closed = False
        self._started = self._taken = self._missed = self._discarded = 0

    @property
    def stats(self) -> WarmPoolStats:
        return WarmPoolStats(self._started, self._taken, self._missed, self._discarded)

    def expect(self, specs: Iterable[PlannedEpisode]) -> None:
        """The episodes :meth:`take` will be asked for, in the order they run; set-ups begin at once."""
        self._upcoming.extend(specs)
        self._fill()

    async def take(self, spec: PlannedEpisode) -> Warmed | None:
        """The episode set up for ``spec`` (waiting for its set-up if that is under way), or ``None``
        (nothing was set up for it: set it up cold). Each planned episode is handed out at most once;
        the pool then begins the next set-up of the plan."""
        self._taken_keys.add(spec.key)  # not to be set up later: it runs now
        entry = self._ready.pop(spec.key, None)
        if entry is None or entry[0] != spec or self._closed:
            if entry is not None:
                await self._discard(entry[1])
            self._missed += 1
            self._fill()
            return None
        self._fill()
        task = entry[1]
        try:
            warmed = await asyncio.shield(task)
        except asyncio.CancelledError:
            # The episode was cancelled while its set-up ran: that set-up is nobody's now.
            await self._discard(task)
            raise
        except Exception as exc:  # not the episode's own set-up failing (that comes back as Warmed)
            log.warning("warm set-up of %s failed (%s: %s); setting it up cold", spec.key,
                        type(exc).__name__, exc)
            self._missed += 1
            return None
        self._taken += 1
        return warmed

    async def close(self) -> None:
        """Remove every set-up not taken (cancelling those under way) and delete their sessions."""
        self._closed = True
        self._upcoming.clear()
        entries, self._ready = list(self._ready.values()), {}
        await asyncio.gather(*(self._discard(t) for _, t in entries), return_exceptions=True)

    # ------------------------------------------------------------------ inside

    def _fill(self) -> None:
        while not self._closed and len(self._ready) < self.size and self._upcoming:
            spec = self._upcoming.popleft()
            if spec.key in self._taken_keys or spec.key in self._ready:
                continue
            self._started += 1
            task = asyncio.create_task(self._warm(spec), name=f"ares-warm-{spec.key}")
            self._ready[spec.key] = (spec, task)

    async def _warm(self, spec: PlannedEpisode) -> Warmed:
        gw = self.gateway
        harness = spec.new_harness()
        session = await gw.create_session(
            metadata={"task": spec.task.name, "harness": harness.name, "attempt": spec.attempt, "warm": True})
        config = spec.episode
        episode = TaskEpisode(spec.task, harness, sandbox=config.sandbox, image=config.image,
                              model=config.model, gateway=gw, save_workspace=spec.workspace,
                              labels={WARM_LABEL: "1"})
        episode.warm = True
        started = time.monotonic()
        try:
            await episode.prepare(session)
        except EpisodeSetupError as exc:  # the episode's to report, as a cold start's would be
            log.info("warm set-up of %s failed: %s", spec.key, exc.message)
        except BaseException:
            await _remove(gw, session, episode)
            raise
        log.debug("warm set-up of %s took %.2fs", spec.key, time.monotonic() - started)
        return Warmed(session, episode)

    async def _discard(self, task: asyncio.Task[Warmed]) -> None:
        """Remove what ``task`` set up (cancelling it if still under way)."""
        self._discarded += 1
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task  # its own handler removes what it had started
            return
        if task.cancelled() or task.exception() is not None:
            return
        w = task.result()
        await _remove(self.gateway, w.session, w.episode)


async def _remove(gw: Gateway, session: SessionInfo, episode: TaskEpisode) -> None:
    """The episode's sandbox removed and its session deleted, shielded from a cancellation around it."""
    async def remove() -> None:
        try:
            await episode.close()
        finally:
            with contextlib.suppress(Exception):
                await gw.delete_session(session.session_id)

    await asyncio.shield(remove())
