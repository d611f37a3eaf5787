"""The :class:`Policy` protocol and :class:`PolicyServer`, which serves a gateway with a policy.

A policy is an async callable ``policy(request) -> answer``: ``request`` is a
:class:`~ares_gateway.ParkedRequest` (when serving a gateway) or a bare
:class:`~ares_gateway.CanonicalRequest` (when called directly); the answer is a
:class:`~ares_gateway.Completion`, or an async iterator of :class:`~ares_gateway.CompletionDelta`
ending with a :class:`~ares_gateway.Completion` (relayed to the agent as it arrives). A policy may
be an ``async def`` returning either, or an async generator function.

>>> async with Gateway(port=0) as gw, PolicyServer(gw, policy, concurrency=8):
...     ...  # agents talk to gw; every request they make is answered by `policy`
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias, runtime_checkable

from ares_gateway.core.answers import ErrorAnswer
from ares_gateway.core.broker import ParkedRequest
from ares_gateway.core.canonical import CanonicalRequest, Completion, CompletionDelta
from ares_gateway.core.errors import (
    GatewayClosedError,
    GatewayError,
    InvalidAnswerError,
    StatusError,
    UnknownSessionError,
)

log = logging.getLogger(__name__)

PolicyRequest: TypeAlias = ParkedRequest | CanonicalRequest
#: What a policy may answer with. ``ErrorAnswer`` sends the agent an HTTP error in its protocol's shape.
PolicyAnswer: TypeAlias = Completion | ErrorAnswer | AsyncIterator[CompletionDelta | Completion]


class PolicyGateway(Protocol):
    """What :class:`PolicyServer` needs of the gateway it serves (:class:`~ares_gateway.Gateway` is one)."""

    async def next_request(
        self, session: str | None = None, *, timeout: float | None = None, lease: float | None = None
    ) -> ParkedRequest | None: ...

    async def respond(self, request_id: str, answer: Any, *, tokens: Any = None) -> None: ...


@runtime_checkable
class Policy(Protocol):
    """Answers one LLM request. See the module docstring for the accepted answers."""

    def __call__(self, request: PolicyRequest,
                 /) -> Awaitable[PolicyAnswer] | AsyncIterator[CompletionDelta | Completion]:
        ...


class PolicyError(StatusError):
    """A policy could not answer; ``status`` is the HTTP status the agent gets (in its protocol's shape)."""

    status = 502

    def to_answer(self) -> ErrorAnswer:
        return ErrorAnswer(self.status, self.message)


def canonical_of(request: PolicyRequest) -> CanonicalRequest:
    """The canonical request, whether given a :class:`ParkedRequest` or a :class:`CanonicalRequest`."""
    return request.request if isinstance(request, ParkedRequest) else request


async def call_policy(policy: Policy, request: PolicyRequest) -> PolicyAnswer:
    """Call ``policy`` and normalize what it gives back to a :data:`PolicyAnswer`.

    Accepts coroutine results, async generators, plain strings (a text reply) and native response
    dicts (passed through to :meth:`Gateway.respond`, which validates them).
    """
    out: Any = policy(request)
    if inspect.isawaitable(out):
        out = await out
    if isinstance(out, str):
        return Completion(text=out)
    if isinstance(out, Completion | ErrorAnswer | dict) or hasattr(out, "__aiter__"):
        return out  # type: ignore[no-any-return]
    raise TypeError(
        f"policy {policy!r} returned {type(out).__name__}: return a Completion, an ErrorAnswer, a "
        "string, or an async iterator of CompletionDelta ending with a Completion"
    )


class OracleTask(Protocol):
    """What the oracle policy needs of a task: its name and one shell command that plays its reference
    solution from the agent's working directory. The task format (Harbor's ``solution/solve.sh``) is
    the episodes' business (:meth:`ares_gateway.episodes.tasks.Task.oracle_command`), not the policy's."""

    name: str

    def oracle_command(self) -> str: ...


@runtime_checkable
class SessionBound(Protocol):
    """A policy that must know each episode's session before answering it: the agent's action format and
    the task (the scripted and oracle policies). The episode driver binds it when the agent's first
    request arrives and unbinds it when the episode ends."""

    def bind(self, session_id: str, *, agent: str, task: Any = None) -> None: ...

    def unbind(self, session_id: str) -> None: ...


@runtime_checkable
class EpisodeReporter(Protocol):
    """A policy with a per-episode report, written to the episode's entry in ``results.json``
    (``tito``: turns, trained tokens, fresh renders, main-line drift)."""

    def episode_report(self, session_id: str, samples: Sequence[Any]) -> dict[str, Any]: ...


@runtime_checkable
class ExternalPolicy(Protocol):
    """A policy that answers outside this process (``http``: a trainer on ``/poll``); ``describe`` is the
    line telling its user where the requests wait."""

    external: bool

    def describe(self, gateway_url: str, *, admin_token_set: bool = False) -> str: ...


def is_external(policy: object) -> bool:
    """Whether requests are answered outside this process (the ``http`` policy): nothing to serve."""
    return bool(getattr(policy, "external", False))


@dataclass
class ServeStats:
    """Counters of one :class:`PolicyServer`."""

    answered: int = 0  # answered by the policy
    failed: int = 0  # the policy raised or gave an invalid answer: the agent got an error answer
    gone: int = 0  # the request was withdrawn before the answer (agent gone, timeout, session deleted)
    in_flight: int = 0


class PolicyServer:
    """Serves a gateway with a policy: ``next_request`` -> ``policy`` -> ``respond``, with at most
    ``concurrency`` requests in the policy at once.

    A request is only taken from the gateway when a slot is free, so requests beyond the bound stay
    parked (and visible to other pollers). A policy exception becomes an error answer to that agent
    (:class:`PolicyError` with its status, anything else 502), never a crash of the loop.
    ``session`` restricts serving to one session. Use ``async with`` or :meth:`start` / :meth:`stop`;
    :meth:`stop` cancels requests still in the policy (their agents get 503 when the gateway closes).
    """

    def __init__(
        self, gateway: PolicyGateway, policy: Policy, *, concurrency: int = 8, session: str | None = None,
        poll_interval: float = 1.0
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        self.gateway = gateway
        self.policy = policy
        self.concurrency = concurrency
        self.session = session
        self.poll_interval = poll_interval
        self.stats = ServeStats()
        self._slots = asyncio.Semaphore(concurrency)
        self._loop_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        if self._loop_task is None and not is_external(self.policy):
            self._loop_task = asyncio.create_task(self._loop(), name="ares-policy-server")

    async def stop(self) -> None:
        """Stop taking requests and cancel those still in the policy."""
        task, self._loop_task = self._loop_task, None
        pending = [t for t in (task, *self._tasks) if t is not None]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def __aenter__(self) -> PolicyServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def serve_forever(self) -> None:
        """Serve until cancelled or the gateway closes."""
        await self.start()
        if self._loop_task is not None:
            await self._loop_task

    async def _loop(self) -> None:
        while True:
            await self._slots.acquire()
            try:
                req = await self.gateway.next_request(self.session, timeout=self.poll_interval)
            except GatewayClosedError:
                self._slots.release()
                return
            except UnknownSessionError:
                # The session this server was bound to is gone: nothing left to serve.
                self._slots.release()
                return
            except BaseException:
                self._slots.release()
                raise
            if req is None:
                self._slots.release()
                continue
            task = asyncio.create_task(self._answer(req), name=f"ares-policy-{req.id}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _answer(self, req: ParkedRequest) -> None:
        self.stats.in_flight += 1
        failed = False
        try:
            try:
                # Inside the gateway's weight-update fence, when it has one: a drain waits for this
                # call, an abort cancels it and it runs again after the resume.
                fence = getattr(self.gateway, "fence", None)
                if fence is not None:
                    answer: Any = await fence.generate(req, lambda: call_policy(self.policy, req))
                else:
                    answer = await call_policy(self.policy, req)
            except asyncio.CancelledError:
                raise
            except PolicyError as exc:
                failed = True
                log.warning("policy failed on %s: %s", req.id, exc)
                answer = exc.to_answer()
            except Exception as exc:
                failed = True
                log.exception("policy raised on %s", req.id)
                answer = ErrorAnswer(502, f"the policy failed: {type(exc).__name__}: {exc}")
            try:
                try:
                    await self.gateway.respond(req.id, answer)
                except InvalidAnswerError as exc:
                    # The policy's answer is unusable; the request is still answerable, so tell the agent.
                    failed = True
                    log.warning("policy gave an invalid answer to %s: %s", req.id, exc)
                    await self.gateway.respond(req.id,
                                               ErrorAnswer(502, f"the policy gave an invalid answer: {exc}"))
                if failed:
                    self.stats.failed += 1
                else:
                    self.stats.answered += 1
            except GatewayError as exc:
                self.stats.gone += 1
                log.info("answer to %s not delivered: %s", req.id, exc)
                with contextlib.suppress(Exception):
                    # A stream we were given but could not deliver must still release its connection.
                    aclose = getattr(answer, "aclose", None)
                    if aclose is not None:
                        await aclose()
        finally:
            self.stats.in_flight -= 1
            self._slots.release()


async def serve(gateway: PolicyGateway, policy: Policy, *, concurrency: int = 8,
                session: str | None = None) -> None:
    """Serve ``gateway`` with ``policy`` until cancelled or the gateway closes (see :class:`PolicyServer`)."""
    server = PolicyServer(gateway, policy, concurrency=concurrency, session=session)
    try:
        await server.serve_forever()
    finally:
        await server.stop()
