"""Where a run's episodes execute: the :class:`Executor` protocol and :class:`LocalExecutor`.

The scheduler (:func:`~ares_gateway.episodes.scheduler.schedule`) hands an executor one
:class:`~ares_gateway.episodes.driver.EpisodeSpec` at a time, at most :attr:`Executor.slots` at once,
and gets each one's :class:`~ares_gateway.episodes.driver.EpisodeRecord` back; the run's outputs are
written where the run is driven, whichever executor ran the episodes.

* :class:`LocalExecutor` (the default): this process, this event loop, one gateway.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from ares_gateway.episodes.driver import EpisodeRecord, EpisodeSpec, drive_episode
from ares_gateway.episodes.episode import episode_gateway
from ares_gateway.episodes.tasks import Task
from ares_gateway.gateway import Gateway
from ares_gateway.policies.base import ExternalPolicy, is_external

__all__ = ["Executor", "LocalExecutor"]


@runtime_checkable
class Executor(Protocol):
    """Runs episodes somewhere (see the module docstring). Used as: ``start``, ``run`` per episode
    (concurrently, up to ``slots``), ``close`` (always, also after a failed or interrupted run)."""

    #: Recorded in ``results.json``'s run settings (``"local"``, ``"ray"``).
    kind: str

    @property
    def slots(self) -> int:
        """How many episodes it runs at once."""
        ...

    async def start(self, *, harness: str, tasks: Sequence[Task], policy: Any, time_limit: float | None,
                    sandbox: str = "auto", image: str | None = None) -> None:
        """Get ready to run episodes of ``tasks`` with ``harness`` in ``sandbox`` sandboxes, answered by
        ``policy``; a place that cannot run them fails here, before any episode starts."""
        ...

    async def run(self, spec: EpisodeSpec) -> EpisodeRecord:
        """Run one episode; cancelling it removes the episode's sandbox."""
        ...

    def turns_answered(self) -> int:
        """LLM requests answered so far (the progress bar's turns/s)."""
        ...

    def describe(self) -> list[str]:
        """Lines for the user at start (an external policy: where its requests wait)."""
        ...

    async def close(self) -> None:
        """Release what :meth:`start` made (gateways, workers)."""
        ...


class LocalExecutor:
    """Episodes in this process, on this event loop, against one gateway (the default executor).

    Args:
        concurrency: episodes at once.
        gateway: a started gateway to use; by default one is built at :meth:`start`
            (:func:`~ares_gateway.episodes.episode.episode_gateway`) and closed at :meth:`close`.
    """

    kind = "local"

    def __init__(self, *, concurrency: int = 4, gateway: Gateway | None = None) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        self.concurrency = concurrency
        self.gateway: Gateway | None = gateway
        self._owns_gateway = gateway is None
        self._policy: Any = None

    @property
    def slots(self) -> int:
        return self.concurrency

    async def start(self, *, harness: str, tasks: Sequence[Task], policy: Any, time_limit: float | None,
                    sandbox: str = "auto", image: str | None = None) -> None:
        # This host's checks (Docker engine, harness install) are the caller's preflight.
        self._policy = policy
        if self.gateway is None:
            longest = max([time_limit or 0.0, *(t.config.agent_timeout for t in tasks)])
            self.gateway = episode_gateway(harness, time_limit=longest)
            await self.gateway.start()

    async def run(self, spec: EpisodeSpec) -> EpisodeRecord:
        if self.gateway is None:
            raise RuntimeError("LocalExecutor.run before start()")
        return await drive_episode(spec, policy=self._policy, gateway=self.gateway)

    def turns_answered(self) -> int:
        return self.gateway.metrics.answered_total if self.gateway is not None else 0

    def describe(self) -> list[str]:
        gw = self.gateway
        if gw is None or not is_external(self._policy):
            return []
        if isinstance(self._policy, ExternalPolicy):
            return [self._policy.describe(gw.url, admin_token_set=bool(gw.config.admin_token))]
        return [f"requests wait on {gw.url}/poll"]

    async def close(self) -> None:
        if self._owns_gateway and self.gateway is not None:
            await self.gateway.close()
            self.gateway = None
