"""Where a run's episodes execute: the :class:`Executor` protocol and :class:`LocalExecutor`.

The scheduler (:func:`~ares_gateway.episodes.scheduler.schedule`) hands an executor one
:class:`~ares_gateway.episodes.driver.EpisodeSpec` at a time, at most :attr:`Executor.slots` at once,
and gets each one's :class:`~ares_gateway.episodes.driver.EpisodeRecord` back; the run's outputs are
written where the run is driven, whichever executor ran the episodes.

* :class:`LocalExecutor` (the default): this process, this event loop, one gateway.

Policy versions and the weight-update fence reach every gateway an executor runs episodes on:
``await executor.set_policy_version(n)``, ``await executor.pause_sampling()`` /
``await executor.resume_sampling(n)`` and ``async with executor.weight_update(n):`` behave as the
:class:`~ares_gateway.gateway.Gateway` methods of the same names, over all of them (a
:class:`~ares_gateway.episodes.ray.RayExecutor`: one gateway per node). They are coroutines on every
executor, since one whose gateways live elsewhere must reach them. A version set before
:meth:`Executor.start` applies to the gateways it starts, and carries over to the next start.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol, runtime_checkable

from ares_gateway.core.canonical import next_policy_version
from ares_gateway.core.errors import SamplingNotPausedError
from ares_gateway.core.fence import PauseReport
from ares_gateway.episodes.driver import EpisodeRecord, EpisodeSpec, drive_episode
from ares_gateway.episodes.episode import episode_gateway
from ares_gateway.episodes.episode_spec import EpisodeConfig
from ares_gateway.episodes.tasks import Task
from ares_gateway.episodes.warm import WarmPool, check_warm
from ares_gateway.gateway import Gateway
from ares_gateway.policies.base import ExternalPolicy, Policy, is_external

__all__ = ["Executor", "LocalExecutor", "fenced_update", "start_executor"]


@runtime_checkable
class Executor(Protocol):
    """Runs episodes somewhere (see the module docstring). Used as: ``start``, ``run`` per episode
    (concurrently, up to ``slots``), ``close`` (always, also after a failed or interrupted run).

    An executor may also have ``expect(specs)``: the episodes ``run`` will be asked for, in the order
    they run, given once after ``start`` (a warm pool sets them up ahead)."""

    #: Recorded in ``results.json``'s run settings (``"local"``, ``"ray"``).
    kind: str

    @property
    def slots(self) -> int:
        """How many episodes it runs at once."""
        ...

    async def start(self, *, tasks: Sequence[Task], policy: Policy, episode: EpisodeConfig) -> None:
        """Get ready to run episodes of ``tasks`` as ``episode`` says (its harness, in its sandboxes),
        answered by ``policy``; a place that cannot run them fails here, before any episode starts."""
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

    @property
    def policy_version(self) -> int | None:
        """The version of the weights the policy samples with now (``None``: never set)."""
        ...

    async def set_policy_version(self, version: int) -> None:
        """:meth:`Gateway.set_policy_version <ares_gateway.gateway.Gateway.set_policy_version>` on every
        gateway (before :meth:`start`: kept for the gateways it starts). Raises
        :class:`~ares_gateway.core.errors.InvalidPolicyVersionError` and
        :class:`~ares_gateway.core.errors.PolicyVersionBackwardsError` as the gateway does."""
        ...

    async def pause_sampling(self, mode: str = "drain", *, timeout: float | None = None) -> PauseReport:
        """:meth:`Gateway.pause_sampling <ares_gateway.gateway.Gateway.pause_sampling>` on every gateway;
        returns once none has a generation in flight. Raises the gateway's
        :class:`~ares_gateway.core.errors.FenceError` subclasses, and ``RuntimeError`` before
        :meth:`start`."""
        ...

    async def resume_sampling(self, version: int | None = None) -> float:
        """:meth:`Gateway.resume_sampling <ares_gateway.gateway.Gateway.resume_sampling>` on every gateway;
        returns the seconds sampling was paused (the longest of them)."""
        ...

    def weight_update(self, version: int | None = None, *, mode: str = "drain",
                      timeout: float | None = None) -> AbstractAsyncContextManager[PauseReport]:
        """``async with executor.weight_update(version):`` pause, update the weights in the body, resume with
        ``version`` (as :meth:`Gateway.weight_update <ares_gateway.gateway.Gateway.weight_update>`)."""
        ...


async def start_executor(executor: Executor, *, tasks: Sequence[Task], policy: Policy,
                         episode: EpisodeConfig) -> None:
    """``executor.start(tasks=, policy=, episode=)``; an executor whose ``start`` still takes the
    settings one by one (``harness=``, ``time_limit=``, ``sandbox=``, ``image=``: deprecated) gets
    them so, with a ``DeprecationWarning``."""
    params = inspect.signature(executor.start).parameters
    if "episode" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        await executor.start(tasks=tasks, policy=policy, episode=episode)
        return
    warnings.warn(f"{type(executor).__name__}.start(harness=, time_limit=, sandbox=, image=) is deprecated: "
                  "take episode=EpisodeConfig (Executor.start(*, tasks, policy, episode))",
                  DeprecationWarning, stacklevel=2)
    old_start: Any = executor.start
    await old_start(harness=episode.harness, tasks=tasks, policy=policy, time_limit=episode.time_limit,
                    sandbox=episode.sandbox, image=episode.image)


@asynccontextmanager
async def fenced_update(pause: Callable[[], Awaitable[PauseReport]],
                        resume: Callable[[int | None], Awaitable[float]],
                        version: int | None) -> AsyncIterator[PauseReport]:
    """An executor's ``weight_update``: ``pause()``, the body, ``resume(version)``; resumed without the new
    version when the body raises (the weights may be half updated: the caller decides what they are)."""
    report = await pause()
    try:
        yield report
    except BaseException:
        await resume(None)
        raise
    await resume(version)


class LocalExecutor:
    """Episodes in this process, on this event loop, against one gateway (the default executor).

    Args:
        concurrency: episodes at once.
        gateway: a started gateway to use; by default one is built at :meth:`start`
            (:func:`~ares_gateway.episodes.episode.episode_gateway`) and closed at :meth:`close`.
        warm: how many of the planned episodes (:meth:`expect`) are set up ahead, their sandboxes
            started and their agents installed while earlier episodes run
            (:class:`~ares_gateway.episodes.warm.WarmPool`); 0: each episode sets up its own.
    """

    kind = "local"

    def __init__(self, *, concurrency: int = 4, gateway: Gateway | None = None, warm: int = 0) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        self.concurrency = concurrency
        self.warm = check_warm(warm)
        #: The warm pool of the current start (``None``: ``warm`` is 0, or not started).
        self.pool: WarmPool | None = None
        self.gateway: Gateway | None = gateway
        self._owns_gateway = gateway is None
        self._policy: Policy | None = None
        # The version for the gateway start() builds (set before it, or kept from the last one closed).
        self._version: int | None = None

    @property
    def slots(self) -> int:
        return self.concurrency

    async def start(self, *, tasks: Sequence[Task], policy: Policy, episode: EpisodeConfig) -> None:
        # This host's checks (Docker engine, harness install) are the caller's preflight.
        self._policy = policy
        if self.gateway is None:
            longest = max([episode.time_limit or 0.0, *(t.config.agent_timeout for t in tasks)])
            self.gateway = episode_gateway(episode.harness, time_limit=longest)
            await self.gateway.start()
            if self._version is not None:
                self.gateway.set_policy_version(self._version)
        if self.warm:
            self.pool = WarmPool(self.gateway, self.warm)

    def expect(self, specs: Sequence[EpisodeSpec]) -> None:
        """The episodes :meth:`run` will be asked for, in order: the warm pool sets them up ahead."""
        if self.pool is not None:
            self.pool.expect(specs)

    async def run(self, spec: EpisodeSpec) -> EpisodeRecord:
        if self.gateway is None or self._policy is None:
            raise RuntimeError("LocalExecutor.run before start()")
        return await drive_episode(spec, policy=self._policy, gateway=self.gateway, warm=self.pool)

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
        pool, self.pool = self.pool, None
        if pool is not None:  # before the gateway: its sessions are deleted there
            await pool.close()
        if self._owns_gateway and self.gateway is not None:
            self._version = self.gateway.policy_version  # the next start's gateway goes on from it
            await self.gateway.close()
            self.gateway = None

    @property
    def policy_version(self) -> int | None:
        return self.gateway.policy_version if self.gateway is not None else self._version

    async def set_policy_version(self, version: int) -> None:
        if self.gateway is not None:
            self.gateway.set_policy_version(version)
        else:
            self._version = next_policy_version(version, self._version)

    async def pause_sampling(self, mode: str = "drain", *, timeout: float | None = None) -> PauseReport:
        if self.gateway is None:
            raise RuntimeError(
                "LocalExecutor.pause_sampling before start(): there is no gateway to pause yet")
        return await self.gateway.pause_sampling(mode, timeout=timeout)

    async def resume_sampling(self, version: int | None = None) -> float:
        if self.gateway is None:
            raise SamplingNotPausedError("sampling is not paused: pause it first")
        return self.gateway.resume_sampling(version)

    def weight_update(self, version: int | None = None, *, mode: str = "drain",
                      timeout: float | None = None) -> AbstractAsyncContextManager[PauseReport]:
        return fenced_update(lambda: self.pause_sampling(mode, timeout=timeout), self.resume_sampling,
                             version)
