"""``GatewayEnv``: an agent run as a dm_env-style environment where one step is one LLM call.

The observation is the agent's pending LLM request (a :class:`ParkedRequest`,
with the canonical request in ``.request``); the action is the answer
(anything :meth:`Gateway.respond` accepts). The episode ends (LAST) when the
session ends: :meth:`Gateway.end_session` (or ``POST /sessions/{id}/end``), the
step limit, or the time limit.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from ares_gateway.broker import ParkedRequest
from ares_gateway.gateway import Gateway
from ares_gateway.sessions import SessionInfo


class StepType(IntEnum):
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


Launcher = Callable[[SessionInfo], Awaitable[Any]]


class GatewayEnv:
    """An async environment over one gateway session at a time.

    ``launch`` (optional) is awaited by :meth:`reset` with the new session's
    :class:`SessionInfo`; it starts the agent (or tells someone to). Without it,
    pass ``session_id`` to attach to a session whose agent is started elsewhere.
    """

    def __init__(
        self,
        gateway: Gateway,
        *,
        session_id: str | None = None,
        launch: Launcher | None = None,
        step_limit: int | None = None,
        time_limit: float | None = None,
        request_timeout: float | None = None,
    ) -> None:
        self.gateway = gateway
        self._attach_to = session_id
        self._launch = launch
        self.step_limit = step_limit
        self.time_limit = time_limit
        self.request_timeout = request_timeout
        self.session: SessionInfo | None = None
        self._current: ParkedRequest | None = None
        self._steps = 0
        self._started = 0.0
        self._done = True

    async def reset(self) -> TimeStep:
        """Start an episode and return FIRST with the agent's first request.

        If the session ends before the agent makes any request, returns LAST.
        """
        await self._end_episode()
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
            await self._launch(self.session)
        request = await self._next_request()
        if request is None:
            return self._last()
        self._current = request
        return TimeStep(StepType.FIRST, None, None, request)

    async def step(self, action: Any) -> TimeStep:
        """Answer the pending request with ``action``; return the next request (MID) or LAST."""
        if self._done or self._current is None:
            raise RuntimeError("no episode in progress: call reset() first")
        current, self._current = self._current, None
        await self.gateway.respond(current.id, action)
        self._steps += 1
        if self.step_limit is not None and self._steps >= self.step_limit:
            self._mark_truncated("step limit reached")
            return self._last()
        request = await self._next_request()
        if request is None:
            return self._last()
        self._current = request
        return TimeStep(StepType.MID, 0.0, 1.0, request)

    async def close(self) -> None:
        """End the episode (if any); pending requests of an env-created session fail."""
        await self._end_episode()

    async def __aenter__(self) -> GatewayEnv:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ internals

    def _remaining(self) -> float | None:
        limits = []
        if self.time_limit is not None:
            limits.append(self.time_limit - (time.monotonic() - self._started))
        if self.request_timeout is not None:
            limits.append(self.request_timeout)
        return max(0.0, min(limits)) if limits else None

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
        remaining = self._remaining()
        poll = asyncio.ensure_future(gw.broker.poll(sid, max_items=1, wait=remaining or 10**9, lease=None))
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
        if not session.ended and self.time_limit is not None and self._remaining() == 0.0:
            self._mark_truncated("time limit reached")
        return None

    def _mark_truncated(self, reason: str) -> None:
        assert self.session is not None
        session = self.gateway.sessions.find(self.session.session_id)
        if session is not None and not session.ended:
            self.gateway.end_session(session.id, reward=None, truncated=True, reason=reason)

    def _last(self) -> TimeStep:
        assert self.session is not None
        self._done = True
        session = self.gateway.sessions.find(self.session.session_id)
        if session is None:
            return TimeStep(StepType.LAST, 0.0, 0.0, None, {"reason": "session deleted", "steps": self._steps})
        truncated = session.truncated
        info = {**session.end_info, "steps": self._steps, "truncated": truncated}
        return TimeStep(StepType.LAST, session.reward or 0.0, 1.0 if truncated else 0.0, None, info)

    async def _end_episode(self) -> None:
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
