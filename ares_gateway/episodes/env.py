"""``GatewayEnv``: an agent run as a dm_env-style environment where one step is one LLM call.

The observation is the agent's pending LLM request (a :class:`ParkedRequest`,
with the canonical request in ``.request``); the action is the answer
(anything :meth:`Gateway.respond` accepts). The episode ends (LAST) when the
session ends: :meth:`Gateway.end_session` (or ``POST /sessions/{id}/end``), the
step limit, or the time limit.

Three ways to get an agent, one constructor each: :meth:`GatewayEnv.attached` to a session
whose agent runs elsewhere, :meth:`GatewayEnv.launching` an agent yourself, or
:meth:`GatewayEnv.for_task` with a task and a harness: then each :meth:`GatewayEnv.reset` starts a
sandbox, installs and launches the real agent CLI in it, and at LAST runs the task's tests for the
reward (the episode loop of :mod:`ares_gateway.episodes.episode`). ``GatewayEnv(...)`` is the
general form that takes every argument.

TimeSteps are built as in dm_env by :func:`restart` (FIRST), :func:`transition` (MID),
:func:`termination` (LAST, discount 0) and :func:`truncation` (LAST, discount 1: a limit ended
the episode, not the agent). Every LAST step's ``info`` says ``truncated`` (a bool) and
``truncation`` (``"step_limit"``, ``"time_limit"``, or ``None``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any

from ares_gateway.core.broker import ParkedRequest
from ares_gateway.core.errors import (
    FencedAnswerError,
    GatewayError,
    InvalidAnswerError,
    RequestGoneError,
    UnknownRequestError,
)
from ares_gateway.core.sessions import SessionInfo
from ares_gateway.gateway import Gateway

if TYPE_CHECKING:
    from ares_gateway.episodes.episode import TaskEpisode
    from ares_gateway.episodes.episode_spec import EpisodeConfig
    from ares_gateway.episodes.result import EpisodeResult
    from ares_gateway.episodes.tasks import Task
    from ares_gateway.episodes.warm import Warmed
    from harnesses import BaseHarness


#: How early the loop's timer may fire against time.monotonic() (uvloop's clock has ms steps).
_CLOCK_SLACK = 0.05


class StepType(IntEnum):
    """Where a :class:`TimeStep` is in its episode, as dm_env's."""

    FIRST = 0
    MID = 1
    LAST = 2


@dataclass(frozen=True, slots=True)
class TimeStep:
    """What ``reset`` and ``step`` return, as in dm_env, plus an ``info`` dict."""

    step_type: StepType
    reward: float | None
    discount: float | None
    observation: ParkedRequest | None
    info: dict[str, Any] = field(default_factory=dict)

    def first(self) -> bool:
        return self.step_type is StepType.FIRST

    def mid(self) -> bool:
        return self.step_type is StepType.MID

    def last(self) -> bool:
        return self.step_type is StepType.LAST


def restart(observation: ParkedRequest, info: dict[str, Any] | None = None) -> TimeStep:
    """FIRST: the episode's first request (no reward, no discount yet)."""
    return TimeStep(StepType.FIRST, None, None, observation, info or {})


def transition(
    reward: float, observation: ParkedRequest, discount: float = 1.0, info: dict[str, Any] | None = None
) -> TimeStep:
    """MID: the agent's next request."""
    return TimeStep(StepType.MID, reward, discount, observation, info or {})


def termination(reward: float, info: dict[str, Any] | None = None) -> TimeStep:
    """LAST with discount 0: the episode ended by itself (the agent finished, or failed)."""
    return TimeStep(
        StepType.LAST, reward, 0.0, None, {**(info or {}), "truncated": False, "truncation": None}
    )


def truncation(
    reward: float, reason: str, info: dict[str, Any] | None = None, discount: float = 1.0
) -> TimeStep:
    """LAST with discount 1: a limit (``reason``: ``"step_limit"`` or ``"time_limit"``) cut the episode."""
    return TimeStep(
        StepType.LAST, reward, discount, None, {**(info or {}), "truncated": True, "truncation": reason}
    )


def _last_step(reward: float, truncated_by: str | None, info: dict[str, Any]) -> TimeStep:
    return termination(reward, info) if truncated_by is None else truncation(reward, truncated_by, info)


Launcher = Callable[[SessionInfo], Awaitable[Any]]

#: Seconds :meth:`GatewayEnv.reset` gives ``launch=`` to return (``launch_timeout=``).
DEFAULT_LAUNCH_TIMEOUT = 120.0


class LaunchTimeoutError(GatewayError, TimeoutError):
    """``launch=`` did not return within ``launch_timeout`` seconds; :meth:`GatewayEnv.reset` raises it
    after cancelling the launch and deleting the session it created."""


class GatewayEnv:
    """An async environment over one gateway session at a time.

    ``launch`` (optional) is awaited by :meth:`reset` with the new session's
    :class:`SessionInfo`; it starts the agent (or tells someone to) and returns once the
    agent is started, not when it finishes: the agent's requests wait for :meth:`step`,
    which cannot come while ``reset`` still awaits ``launch``. Start the agent with
    ``asyncio.create_subprocess_exec`` or ``asyncio.create_task`` and return. Its return
    value is ignored. When it raises, ``reset`` deletes the session and raises that error;
    when it has not returned after ``launch_timeout`` seconds (default
    :data:`DEFAULT_LAUNCH_TIMEOUT`; ``None`` waits for ever), ``reset`` cancels it, deletes
    the session and raises :class:`LaunchTimeoutError`. Without ``launch``, pass
    ``session_id`` to attach to a session whose agent is started elsewhere.

    With ``task`` (a :class:`~ares_gateway.episodes.tasks.Task` or its directory) and ``harness``
    (a registry name such as ``"mini-swe-agent"``, or a harness object), each episode
    runs that agent on the task in a fresh ``sandbox`` (``auto`` | ``local`` | ``docker``
    | ``daytona``; ``image`` for container backends): :meth:`reset` returns FIRST with the
    agent's first request; LAST comes when the agent exits (the reward is the task's
    tests'), at ``step_limit`` / ``time_limit`` (truncation: discount 1.0, the agent is
    stopped, the tests still run), or on a failure (reward 0.0, ``info["error"]``; no
    exception, no leaked sandbox). ``time_limit`` (default: the task's agent timeout)
    counts from the agent's launch. The sandbox is removed at LAST; the session (and
    :meth:`trajectory`) stays until the next :meth:`reset` or :meth:`close`.
    ``gateway`` may be omitted in this mode: the env then runs its own, with the
    harness's side-call detector.

    This is the general form; the named constructors take only what their mode uses:
    :meth:`attached`, :meth:`launching`, :meth:`for_task`.
    """

    @classmethod
    def attached(
        cls,
        gateway: Gateway,
        *,
        session_id: str,
        step_limit: int | None = None,
        time_limit: float | None = None,
        request_timeout: float | None = None,
    ) -> GatewayEnv:
        """Steps over an existing session whose agent is started elsewhere (the session is kept at close)."""
        return cls(gateway, session_id=session_id, step_limit=step_limit, time_limit=time_limit,
                   request_timeout=request_timeout)

    @classmethod
    def launching(
        cls,
        gateway: Gateway,
        *,
        launch: Launcher,
        launch_timeout: float | None = DEFAULT_LAUNCH_TIMEOUT,
        step_limit: int | None = None,
        time_limit: float | None = None,
        request_timeout: float | None = None,
    ) -> GatewayEnv:
        """Each :meth:`reset` creates a session and awaits ``launch(session_info)``, which starts the
        agent and returns (see the class docstring for ``launch_timeout``)."""
        return cls(gateway, launch=launch, launch_timeout=launch_timeout, step_limit=step_limit,
                   time_limit=time_limit, request_timeout=request_timeout)

    @classmethod
    def for_task(
        cls,
        task: Task | str | os.PathLike[str],
        episode: EpisodeConfig | None = None,
        *,
        harness: str | BaseHarness | None = None,
        sandbox: str = "auto",
        gateway: Gateway | None = None,
        image: str | None = None,
        model: str = "ares-policy",
        step_limit: int | None = None,
        time_limit: float | None = None,
        request_timeout: float | None = None,
        save_workspace: str | os.PathLike[str] | None = None,
        prepared: Warmed | None = None,
    ) -> GatewayEnv:
        """Each :meth:`reset` runs the episode's harness on ``task`` in a fresh sandbox; LAST carries the
        task's reward. ``episode``: what each episode runs (:class:`~ares_gateway.EpisodeConfig`: the
        harness and its options, the sandbox, image, model, step and time limits), the same config
        :func:`~ares_gateway.run_rollouts` takes; or those settings as keywords (``harness=``,
        ``sandbox=``, ...). ``harness=`` may also be a harness object (a configured or custom harness,
        which a config, naming a registered harness, cannot hold): it runs in place of the config's
        harness. Without ``gateway`` the env runs its own. ``save_workspace``: a file path where
        each episode's final workdir is saved as a tar before its tests run
        (:mod:`~ares_gateway.episodes.workspaces`; each episode overwrites it). ``prepared``: an episode
        a warm pool set up on ``gateway`` (:mod:`~ares_gateway.episodes.warm`), which the first
        :meth:`reset` launches instead of setting one up; :meth:`close` removes it if no reset did."""
        return cls(gateway, task=task, episode=episode, harness=harness, sandbox=sandbox, image=image,
                   model=model, step_limit=step_limit, time_limit=time_limit,
                   request_timeout=request_timeout, save_workspace=save_workspace, prepared=prepared)

    def __init__(
        self,
        gateway: Gateway | None = None,
        *,
        session_id: str | None = None,
        launch: Launcher | None = None,
        launch_timeout: float | None = DEFAULT_LAUNCH_TIMEOUT,
        step_limit: int | None = None,
        time_limit: float | None = None,
        request_timeout: float | None = None,
        task: Task | str | os.PathLike[str] | None = None,
        episode: EpisodeConfig | None = None,
        harness: str | BaseHarness | None = None,
        sandbox: str = "auto",
        image: str | None = None,
        model: str = "ares-policy",
        save_workspace: str | os.PathLike[str] | None = None,
        prepared: Warmed | None = None,
    ) -> None:
        self._task: Task | None = None
        self._prepared = prepared
        if prepared is not None and (task is None or gateway is None):
            raise ValueError("GatewayEnv(prepared=...) needs task= and the gateway the episode was set up on")
        self.save_workspace = save_workspace
        #: What each episode runs (task mode): the ``episode`` given, or the one the keywords made.
        self.config: EpisodeConfig | None = None
        if task is not None:
            from ares_gateway.episodes.tasks import Task as _Task

            self._task = task if isinstance(task, _Task) else _Task.load(task)
            if launch is not None or session_id is not None:
                raise ValueError(
                    "GatewayEnv(task=...) launches the agent itself: pass no launch= or session_id="
                )
            self.config = _episode_config(episode, harness, sandbox=sandbox, image=image, model=model,
                                          step_limit=step_limit, time_limit=time_limit)
            sandbox, image, model = self.config.sandbox, self.config.image, self.config.model
            step_limit, time_limit = self.config.step_limit, self.config.time_limit
            if time_limit is None:
                time_limit = self._task.config.agent_timeout
            if harness is None or isinstance(harness, str):
                harness = self.config.harness
        elif harness is not None or episode is not None:
            raise ValueError(f"GatewayEnv({'harness' if episode is None else 'episode'}=...) needs task=")
        self._harness: str | BaseHarness | None = harness
        self._owns_gateway = gateway is None
        if gateway is None:
            if self._task is None:
                raise ValueError("GatewayEnv needs a gateway (or task= and harness=, and it runs its own)")
            from ares_gateway.episodes.episode import episode_gateway

            # The policy is in process: the control HTTP API is closed to everyone.
            assert harness is not None and time_limit is not None
            gateway = episode_gateway(harness, time_limit=time_limit)
        self.gateway = gateway
        self._attach_to = session_id
        self._launch = launch
        if launch_timeout is not None and launch_timeout <= 0:
            raise ValueError(f"launch_timeout must be positive (or None), got {launch_timeout}")
        self.launch_timeout = launch_timeout
        self.step_limit = step_limit
        self.time_limit = time_limit
        self.request_timeout = request_timeout
        self.sandbox_backend = sandbox
        self.image = image
        self.model = model
        self.session: SessionInfo | None = None
        #: The running task episode (task mode), and how the last one ended.
        self.episode: TaskEpisode | None = None
        self.outcome: EpisodeResult | None = None
        #: The last episode's logs (task mode): the agent's ``stdout.log`` and ``stderr.log``, the
        #: harness's artifacts, ``verifier.log``.
        self.logs: dict[str, str] = {}
        self._current: ParkedRequest | None = None
        self._steps = 0
        self._started = 0.0
        self._done = True

    @property
    def task(self) -> Task | None:
        return self._task

    async def reset(self) -> TimeStep:
        """Start an episode and return FIRST with the agent's first request.

        If the session ends before the agent makes any request, returns LAST.
        """
        await self._end_episode()
        if self._task is not None:
            return await self._reset_task()
        gw = self.gateway
        if self._attach_to is not None:
            session = gw.sessions.get(self._attach_to)
            self.session = gw._info(session)
        else:
            self.session = await gw.create_session()
        self._steps = 0
        self._started = time.monotonic()
        self._done = False
        if self._launch is not None:
            await self._run_launch(self._launch, self.session)
        request = await self._next_request()
        if request is None:
            return self._last()
        self._current = request
        return restart(request)

    async def step(self, action: Any) -> TimeStep:
        """Answer the pending request with ``action``; return the next request (MID) or LAST.

        An action the gateway cannot use raises :class:`~ares_gateway.core.errors.InvalidAnswerError` and
        leaves the request pending: step again with another answer (e.g. an ``ErrorAnswer``).
        """
        if self._done or self._current is None:
            raise RuntimeError("no episode in progress: call reset() first")
        if self.episode is not None:
            return await self._guard(self._step(action))
        return await self._step(action)

    async def _step(self, action: Any) -> TimeStep:
        current, self._current = self._current, None
        assert current is not None
        try:
            await self.gateway.respond(current.id, action)
        except InvalidAnswerError:
            # The request is still pending: the caller may step again with another answer.
            self._current = current
            raise
        except FencedAnswerError:
            # An abort fence took the request back while this answer was sampled: it is dropped, and
            # the same request comes back (after the resume) to be sampled with the new weights.
            request = await self._next_request()
            if request is None:
                return await self._conclude() if self.episode is not None else self._last()
            self._current = request
            return transition(0.0, request)
        except (RequestGoneError, UnknownRequestError):
            if self.episode is None:
                raise
            # The agent is gone (it exited or was stopped); the episode ends below.
        self._steps += 1
        if self.step_limit is not None and self._steps >= self.step_limit:
            self._mark_truncated("step_limit", "step limit reached")
            return await self._conclude()
        request = await self._next_request()
        if request is None:
            return await self._conclude()
        self._current = request
        return transition(0.0, request)

    async def close(self) -> None:
        """End the episode (if any); pending requests of an env-created session fail.

        In task mode the agent is stopped and the sandbox removed; an env that runs its own
        gateway closes it.
        """
        await self._end_episode()
        prepared, self._prepared = self._prepared, None
        if prepared is not None:  # set up ahead, never launched
            try:
                await prepared.episode.close()
            finally:
                with contextlib.suppress(Exception):
                    await self.gateway.delete_session(prepared.session.session_id)
        if self._owns_gateway:
            await self.gateway.close()

    async def __aenter__(self) -> GatewayEnv:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ internals

    async def _run_launch(self, launch: Launcher, session: SessionInfo) -> None:
        """Await ``launch(session)`` within :attr:`launch_timeout`; on a failure, drop the session."""
        try:
            async with asyncio.timeout(self.launch_timeout):
                await launch(session)
        except TimeoutError:
            waiting = self.gateway.broker.pending_for(session.session_id)
            await self._end_episode()
            raise LaunchTimeoutError(
                f"launch= did not return within {self.launch_timeout:g} s"
                + (f" ({waiting} request(s) of the agent already wait for an answer)" if waiting else "")
                + ": launch must start the agent (asyncio.create_subprocess_exec, asyncio.create_task) and "
                "return, not wait for it to finish, since its requests are answered through step(); "
                "raise launch_timeout= if starting it takes longer"
            ) from None
        except BaseException:
            await self._end_episode()
            raise

    def _wait_limit(self) -> tuple[float | None, bool]:
        """How long the next wait may last (None: no limit), and whether the time limit is what ends it."""
        time_left = (
            None if self.time_limit is None
            else max(0.0, self.time_limit - (time.monotonic() - self._started))
        )
        if self.request_timeout is None or (time_left is not None and time_left <= self.request_timeout):
            return time_left, time_left is not None
        return self.request_timeout, False

    async def _next_request(self) -> ParkedRequest | None:
        """The session's next request, or None when the session ended or a limit ran out."""
        assert self.session is not None
        gw = self.gateway
        sid = self.session.session_id
        session = gw.sessions.find(sid)
        if session is None:
            return None
        got = gw.broker.take(sid, 1, None)  # fast path: the agent is already waiting
        if got:
            return got[0]
        if session.ended:
            return None
        # When the time limit ends the wait, an empty poll means the limit is reached, even where the
        # loop's clock (uvloop's, cached per iteration in ms) ran the timer a hair before
        # time.monotonic() got there (the episode then ended untruncated, now and then).
        remaining, at_time_limit = self._wait_limit()
        poll = asyncio.ensure_future(
            gw.broker.poll(sid, max_items=1, wait=10**9 if remaining is None else remaining, lease=None)
        )
        ended = asyncio.ensure_future(session.ended_event.wait())
        try:
            await asyncio.wait({poll, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
            if not poll.done():
                poll.cancel()
                await asyncio.gather(poll, return_exceptions=True)
        if poll.done() and not poll.cancelled() and poll.result():
            return poll.result()[0]
        if not session.ended and at_time_limit and (self._wait_limit()[0] or 0.0) <= _CLOCK_SLACK:
            self._mark_truncated("time_limit", "time limit reached")
        return None

    def _mark_truncated(self, kind: str, reason: str) -> None:
        assert self.session is not None
        session = self.gateway.sessions.find(self.session.session_id)
        if session is not None and not session.ended:
            self.gateway.end_session_nowait(
                session.id, reward=None, truncated=True, reason=reason, truncation=kind
            )

    def _last(self) -> TimeStep:
        assert self.session is not None
        self._done = True
        session = self.gateway.sessions.find(self.session.session_id)
        if session is None:
            return termination(0.0, {"reason": "session deleted", "steps": self._steps})
        info = {**session.end_info, "steps": self._steps}
        return _last_step(session.reward or 0.0, _truncation_of(session.truncated, session.end_info), info)

    async def _conclude(self) -> TimeStep:
        """LAST: in task mode stop the agent, run the tests and remove the sandbox first."""
        if self.episode is None:
            return self._last()
        assert self.session is not None
        gw = self.gateway
        sid = self.session.session_id
        session = gw.sessions.find(sid)
        truncated_by = None if session is None else _truncation_of(session.truncated, session.end_info)
        episode = self.episode
        try:
            outcome = await episode.finish(truncation=truncated_by)
        finally:
            await episode.close()
        return self._finish_task(outcome, episode.logs)

    def _finish_task(self, outcome: EpisodeResult, logs: dict[str, str]) -> TimeStep:
        assert self.session is not None
        self.outcome = outcome
        self._done = True
        self._current = None
        self.logs = logs
        info = {**step_info(outcome), "steps": self._steps}
        sid = self.session.session_id
        if self.gateway.sessions.find(sid) is not None:
            # The final reward goes on the session, so trajectory() and GET /sessions/{id} carry it.
            extra = {k: v for k, v in info.items() if k != "truncated"}
            self.gateway.end_session_nowait(sid, reward=outcome.reward, truncated=outcome.truncated, **extra)
        return _last_step(outcome.reward, outcome.exit_reason if outcome.truncated else None, info)

    async def _guard(self, step: Awaitable[TimeStep]) -> TimeStep:
        """Task mode: a cancellation (or an unexpected error) removes the sandbox before it propagates.
        An invalid answer does not: the episode goes on and the request waits for another one."""
        try:
            return await step
        except InvalidAnswerError:
            raise
        except BaseException:
            await self._end_episode()
            raise

    async def _reset_task(self) -> TimeStep:
        from ares_gateway.episodes.episode import EpisodeSetupError, TaskEpisode

        assert self._task is not None and self._harness is not None
        gw = self.gateway
        if self._owns_gateway:
            await gw.start()
        task = self._task
        prepared, self._prepared = self._prepared, None
        if prepared is not None:
            self.session, episode = prepared.session, prepared.episode
        else:
            harness_name = self._harness if isinstance(self._harness, str) else self._harness.name
            self.session = await gw.create_session(metadata={"task": task.name, "harness": harness_name})
            harness: str | BaseHarness = self._harness
            if isinstance(harness, str) and self.config is not None:
                harness = self.config.new_harness()  # with the config's harness options
            episode = TaskEpisode(task, harness, sandbox=self.sandbox_backend, image=self.image,
                                  model=self.model, gateway=gw, save_workspace=self.save_workspace)
        sid = self.session.session_id
        self._steps = 0
        self._done = False
        self.outcome = None
        self.logs = {}
        self.episode = episode

        async def start() -> TimeStep:
            limit = self.time_limit if self.time_limit is not None else task.config.agent_timeout
            try:
                # The harness's own budget is a backstop a little past the env's limit.
                await episode.start(self.session, time_budget=limit + 30.0)  # type: ignore[arg-type]
            except EpisodeSetupError:
                outcome = await episode.finish()
                await episode.close()
                return self._finish_task(outcome, episode.logs)
            self._started = time.monotonic()  # the time limit counts from the agent's launch
            assert episode.agent is not None
            episode.agent.add_done_callback(lambda _t: self._agent_exited(sid))
            request = await self._next_request()
            if request is None:
                return await self._conclude()
            self._current = request
            return restart(request)

        return await self._guard(start())

    def _agent_exited(self, sid: str) -> None:
        session = self.gateway.sessions.find(sid)
        if session is not None and not session.ended:
            self.gateway.end_session_nowait(sid, reason="agent exited")

    async def _end_episode(self) -> None:
        episode, self.episode = self.episode, None
        if episode is not None:
            await episode.close()
        if self.session is None:
            return
        sid = self.session.session_id
        gw = self.gateway
        if self._attach_to is None and gw.sessions.find(sid) is not None:
            await gw.delete_session(sid)
        self._current = None
        self._done = True
        if self._attach_to is None:
            self.session = None

    def trajectory(self, *, max_sample_tokens: int = 0) -> list[Any]:
        """Training samples of the current (or just finished) episode."""
        if self.session is None:
            raise RuntimeError("no episode: call reset() first")
        return self.gateway.trajectory(self.session.session_id, max_sample_tokens=max_sample_tokens)

    def turn_log(self) -> list[dict[str, Any]]:
        """The raw turn log of the current (or just finished) episode."""
        if self.session is None:
            raise RuntimeError("no episode: call reset() first")
        return self.gateway.turn_log(self.session.session_id)


def _truncation_of(truncated: bool, end_info: dict[str, Any]) -> str | None:
    """What cut a session short: the env's own mark, else whatever ended it with ``truncated=True``."""
    if not truncated:
        return None
    kind = end_info.get("truncation")
    return kind if isinstance(kind, str) and kind else "truncated"


def _episode_config(episode: EpisodeConfig | None, harness: str | BaseHarness | None, *, sandbox: str,
                    image: str | None, model: str, step_limit: int | None,
                    time_limit: float | None) -> EpisodeConfig:
    """The task mode's :class:`EpisodeConfig`: ``episode`` itself (nothing of it given again as a
    keyword, a harness object aside), or the one the keywords make (checked as every config is)."""
    from ares_gateway.episodes.episode_spec import EpisodeConfig

    if episode is None:
        if harness is None:
            raise ValueError("GatewayEnv(task=...) needs the episode's harness: episode=EpisodeConfig("
                             "harness='mini-swe-agent', ...) or harness='mini-swe-agent'")
        name = harness if isinstance(harness, str) else harness.name
        return EpisodeConfig(harness=name, sandbox=sandbox, image=image, model=model,
                             step_limit=step_limit, time_limit=time_limit)
    if not isinstance(episode, EpisodeConfig):
        raise TypeError(f"episode must be an EpisodeConfig, got {type(episode).__name__}")
    given = [name for name, value, default in (
        ("harness", harness if isinstance(harness, str) else None, None), ("sandbox", sandbox, "auto"),
        ("image", image, None), ("model", model, "ares-policy"), ("step_limit", step_limit, None),
        ("time_limit", time_limit, None)) if value != default]
    if given:
        raise TypeError(f"GatewayEnv got {', '.join(given)} beside episode=: set "
                        f"{'it' if len(given) == 1 else 'them'} in the EpisodeConfig")
    return episode


def step_info(result: EpisodeResult) -> dict[str, Any]:
    """What a task episode's LAST ``TimeStep.info`` says of how it ended (JSON-able; also put on the
    session when it ends): a :class:`TaskEpisode`'s result before the driver adds what the gateway
    recorded. ``workspace_bytes`` here is the size of the workdir's archive copied for grading, and
    ``saved_workspace`` the file the workspace was saved to."""
    out: dict[str, Any] = {
        "task": result.task,
        "harness": result.harness,
        "exit_reason": result.exit_reason,
        "truncated": result.truncated,
        "truncation": result.exit_reason if result.truncated else None,
        "reward_parts": dict(result.reward_parts),
        "reward_source": result.reward_source,
        "agent_exit_code": result.agent_exit_code,
        "setup_seconds": round(result.setup_seconds, 3),
        "agent_seconds": round(result.agent_seconds, 3),
        "verify_seconds": round(result.verify_seconds, 3),
        "install_reused": result.install_reused,
        "warm": result.warm,
        "sandbox": result.sandbox,
        "network": result.network,
        "grading": result.grading,
        "grading_setup_seconds": round(result.grading_setup_seconds, 3),
        "workspace_bytes": result.copied_bytes,
        "saved_workspace": result.workspace,
        "workspace_truncated": result.workspace_truncated,
    }
    if result.workspace_error is not None:
        out["workspace_error"] = result.workspace_error
    if result.error is not None:
        out["error"] = result.error
    if result.verifier_error is not None:
        out["verifier_error"] = result.verifier_error
        out["verifier_crashed"] = result.verifier_crashed
    if result.failure_site:
        out["failure_site"] = result.failure_site
    return out
