"""The broker: every agent request is parked here until a policy answers it.

A parked request is delivered to pollers under a lease: if it is not answered
before the lease runs out it becomes available again (with ``attempt`` + 1), so
a poller that dies loses nothing. Answering, timing out and the agent going
away are mutually exclusive and decided synchronously on the event loop, so a
successful ``respond`` means the agent's handler received the answer.

The broker knows neither HTTP nor the wire protocols: it holds canonical requests, reads each
answer with :func:`~ares_gateway.core.answers.coerce_answer`, resolves each request's future
exactly once, and hands every answered turn, whole or streamed, to :mod:`ares_gateway.core.recorder`
(:func:`~ares_gateway.core.recorder.record_turn`, :func:`~ares_gateway.core.recorder.record_stream`).
A request whose waiter was cancelled (the agent's handler, when its client disconnects) counts
as gone from that instant: ``respond`` withdraws it and raises :class:`RequestGoneError`, even
when the handler's task has not run again yet to withdraw it itself.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import orjson
from pydantic import BaseModel

from ares_gateway.core._body_layout import LayoutHint
from ares_gateway.core.answers import (
    Answer,
    AnswerLike,
    NativeAnswer,
    StreamAnswer,
    coerce_answer,
    read_tokens,
)
from ares_gateway.core.canonical import (
    CanonicalRequest,
    Completion,
    TokenRecord,
    WireProtocol,
    read_policy_version,
)
from ares_gateway.core.errors import (
    AlreadyAnsweredError,
    FencedAnswerError,
    GatewayClosedError,
    RequestGoneError,
    StatusError,
    TooManyParkedError,
    UnknownRequestError,
)
from ares_gateway.core.recorder import TurnSink, record_stream, record_turn
from ares_gateway.core.wire import MAX_JSON_DEPTH

log = logging.getLogger(__name__)

_TOMBSTONES = 100_000
# The deadline timer may fire up to libuv's millisecond resolution early; what is due within
# this much counts as due, so an early firing does not re-arm for the same instant.
_SLACK = 0.001
# After a pass over n pending requests the timer waits at least n times this before the next
# pass, so passes take at most about 1% of the loop however many distinct deadlines there are
# (a poller that took 10,000 requests one by one and died: their leases end one by one).
_GAP_PER_PENDING = 20e-6


class _State(Enum):
    ANSWERED = "answered"
    GONE = "gone"


class RequestClosed(StatusError):
    """Raised into the agent's handler when its request ends without an answer (``reason``: why)."""

    def __init__(self, reason: str, status: int, message: str) -> None:
        super().__init__(message, status=status)
        self.reason = reason


@dataclass(eq=False, slots=True)
class ParkedRequest:
    """One agent request waiting for its answer."""

    id: str
    session_id: str
    protocol: WireProtocol
    endpoint: str
    request: CanonicalRequest
    timestamp: float
    future: asyncio.Future[Answer]
    side_call: bool = False
    attempt: int = 0
    #: The request body exactly as received, when it came over HTTP (sent to pollers verbatim).
    raw_body: bytes | None = field(default=None, repr=False)
    #: Bytes this request holds of its session's ``max_parked_bytes_per_session``.
    held_bytes: int = 0
    #: Where the body's list lies in ``raw_body``, as its parse found (for the recorder), if known.
    layout: LayoutHint | None = field(default=None, repr=False)
    #: The gateway's policy version when the request was handed to the policy (taken, or answered
    #: untaken), or the one the answer gave; the turn's version unless its completion reports one.
    policy_version: int | None = None
    #: Wall time the policy last took the request (``take``/``poll``; ``None``: never taken).
    taken_at: float | None = None
    #: Loop time at which the request times out (``inf``: never).
    _expires: float = field(default=math.inf, repr=False)
    #: Loop time at which the current lease runs out (``None``: not leased, or leased for good).
    _lease_until: float | None = field(default=None, repr=False)
    _head: bytes | None = field(default=None, repr=False)
    _body: bytes | None = field(default=None, repr=False)
    _canonical: bytes | None = field(default=None, repr=False)
    _encoder: CanonicalEncoder | None = field(default=None, repr=False)
    #: Taken by an in-process generation of the weight-update fence (``SamplingFence.generate``).
    _owned: bool = field(default=False, repr=False)
    #: Taken back from its poller by an abort fence: an answer to it is refused until it is taken again.
    _fenced: bool = field(default=False, repr=False)

    def _fields(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "session_id": self.session_id,
            "protocol": self.protocol.value,
            "endpoint": self.endpoint,
            "timestamp": self.timestamp,
            "side_call": self.side_call,
        }

    def poll_item(self) -> dict[str, Any]:
        """The item ``/poll`` returns, as plain JSON-able values (ares-proxy readers use id, request,
        timestamp)."""
        return {
            **self._fields(),
            "request": self.request.raw,
            "canonical": self.request.model_dump(mode="json", exclude={"raw"}),
            "attempt": self.attempt,
        }

    def poll_parts(self, *, canonical: bool = True) -> list[bytes]:
        """:meth:`poll_item` encoded as JSON, in pieces whose concatenation is the item: the agent's
        body bytes as received (never re-encoded) and the canonical form encoded once however often
        it is delivered, so that ``/poll`` copies each only into its response.
        ``canonical=False`` leaves it out (for pollers that read only the native body)."""
        head = self._head
        if head is None:
            # Encoded first: a body that cannot be encoded raises before anything is kept.
            self._body = self.raw_body if self.raw_body is not None else orjson.dumps(self.request.raw)
            head = self._head = orjson.dumps(self._fields())[:-1] + b',"request":'
        assert self._body is not None
        tail = b',"attempt":%d}' % self.attempt
        if not canonical:
            return [head, self._body, tail]
        encoded = self._canonical
        if encoded is None:
            enc = self._encoder
            encoded = self._canonical = (_canonical_json(self.request) if enc is None
                                         else enc.encode(self.request))
        return [head, self._body, b',"canonical":', encoded, tail]

    def poll_json(self, *, canonical: bool = True) -> bytes:
        """:meth:`poll_parts` joined: the item as one JSON document."""
        return b"".join(self.poll_parts(canonical=canonical))


def _model_fields(value: Any) -> dict[str, Any]:
    if isinstance(value, BaseModel):
        return value.__dict__
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


#: Why a request nested past :data:`~ares_gateway.core.wire.MAX_JSON_DEPTH` (in a free-form field) is
#: refused: its agent's 400, from the body parser, before it is parked (the turn could be neither
#: recorded nor handed on; ``/poll`` refuses one it cannot encode the same way).
UNENCODABLE_REQUEST = ("the request cannot be handed to the policy: it nests objects or arrays too deeply "
                       f"(at most {MAX_JSON_DEPTH} levels); send a flatter body")


def _canonical_json(request: CanonicalRequest) -> bytes:
    """``request.model_dump_json(exclude={"raw"})``, the same bytes at about half the cost.

    The canonical models have no aliases, computed fields or custom serializers, so each
    one serializes as its field dict; orjson walks those itself. Anything orjson cannot
    encode (an integer over 64 bits put there in process, say) goes through pydantic.
    The one difference: a NaN or infinity (which no JSON body can carry) is written as
    ``null``, valid JSON, where pydantic writes ``NaN``.
    """
    fields = {k: v for k, v in request.__dict__.items() if k != "raw"}
    try:
        return orjson.dumps(fields, default=_model_fields)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return request.model_dump_json(exclude={"raw"}).encode()


class CanonicalEncoder:
    """Encodes one line of a session's canonical requests for ``/poll`` (as :func:`_canonical_json`,
    the same bytes), reusing the encoding of the messages and tools each shares with the last one
    it encoded: the very objects, which the HTTP layer's parse takes over from the previous request
    of the line. A long session's canonical form then costs what its new messages cost.

    Keeps the last request's messages and their encodings (about the size of its canonical form).
    """

    __slots__ = ("_messages", "_pieces", "_tools", "_tools_json")

    def __init__(self) -> None:
        self._messages: list[Any] = []
        self._pieces: list[bytes] = []
        self._tools: list[Any] | None = None
        self._tools_json = b""

    def encode(self, request: CanonicalRequest) -> bytes:
        msgs = request.messages
        prev = self._messages
        k = 0
        n = min(len(prev), len(msgs))
        while k < n and msgs[k] is prev[k]:
            k += 1
        try:
            pieces = self._pieces[:k] + [orjson.dumps(m, default=_model_fields) for m in msgs[k:]]
            tools = request.tools
            tools_json = (self._tools_json if tools is self._tools
                          else orjson.dumps(tools, default=_model_fields))
            fields = {k: v for k, v in request.__dict__.items() if k != "raw"}
            fields["messages"] = orjson.Fragment(b"[" + b",".join(pieces) + b"]")
            fields["tools"] = orjson.Fragment(tools_json)
            out = orjson.dumps(fields, default=_model_fields)
        except TypeError:  # what orjson cannot encode: pydantic's way (or its error), and nothing kept
            return _canonical_json(request)
        self._messages, self._pieces, self._tools, self._tools_json = list(msgs), pieces, tools, tools_json
        return out


class _Waiter:
    __slots__ = ("deadline", "future", "session_id")

    def __init__(self, session_id: str | None, future: asyncio.Future[None], deadline: float) -> None:
        self.session_id = session_id
        self.future = future
        self.deadline = deadline


class Broker:
    """Parks requests, leases them to pollers, and resolves them exactly once.

    Request timeouts, lease expiries and long-poll waits share one loop timer, armed for the
    earliest deadline, instead of a timer per request and per poll: arming and cancelling
    those was about 5% of an agent turn. When it fires, one pass over the pending requests
    and waiters settles what is due and re-arms for the next deadline, or later by up to 20 µs
    per pending request (0.2 s with 10,000 pending), which bounds the passes' cost.
    """

    def __init__(
        self,
        *,
        request_timeout: float = 900.0,
        lease_seconds: float = 120.0,
        on_turn: TurnSink | None = None,
        metrics: Any = None,
        max_parked_per_session: int | None = None,
        max_parked_bytes_per_session: int | None = None,
        max_parked_bytes: int | None = None,
    ) -> None:
        if max_parked_per_session is not None and max_parked_per_session < 1:
            raise ValueError("max_parked_per_session must be at least 1 (or None: no limit)")
        if max_parked_bytes_per_session is not None and max_parked_bytes_per_session < 1:
            raise ValueError("max_parked_bytes_per_session must be at least 1 (or None: no limit)")
        if max_parked_bytes is not None and max_parked_bytes < 1:
            raise ValueError("max_parked_bytes must be at least 1 (or None: no limit)")
        self.request_timeout = request_timeout
        self.lease_seconds = lease_seconds
        #: Requests one session may have parked at once; more get :class:`TooManyParkedError` (429).
        #: ``None`` here; the gateway sets its ``GatewayConfig.max_parked_per_session``.
        self.max_parked_per_session = (max_parked_per_session if max_parked_per_session is not None
                                       else math.inf)
        # Each session's parked requests: its count for the cap, and what close_session ends without
        # a scan over every session's (thousands at once on a remote-sandbox run).
        self._parked_by_session: dict[str, dict[str, ParkedRequest]] = {}
        #: Body bytes one session may hold at once: its parked requests' and those being read or
        #: parsed (:meth:`hold_bytes`); more get :class:`TooManyParkedError` (429). The gateway sets
        #: its ``GatewayConfig.max_parked_bytes_per_session``.
        self.max_parked_bytes_per_session = (
            max_parked_bytes_per_session if max_parked_bytes_per_session is not None else math.inf
        )
        self._bytes_by_session: dict[str, int] = {}
        #: Body bytes every session together may hold at once (the same count, summed); more get
        #: :class:`TooManyParkedError` (429). The gateway sets its ``GatewayConfig.max_parked_bytes``.
        self.max_parked_bytes = max_parked_bytes if max_parked_bytes is not None else math.inf
        #: Body bytes held now, every session's together.
        self.parked_bytes = 0
        self._on_turn = on_turn
        self._metrics = metrics
        self._pending: dict[str, ParkedRequest] = {}
        self._available: dict[str, ParkedRequest] = {}
        self._available_by_session: dict[str, dict[str, ParkedRequest]] = {}
        self._waiters: deque[_Waiter] = deque()
        self._done: OrderedDict[str, _State] = OrderedDict()
        self._ids = itertools.count(1)
        self._closed = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        #: Passes the deadline timer has made over the pending requests (each costs O(pending)).
        self.deadline_passes = 0
        #: The version of the weights the policy samples with now (``Gateway.set_policy_version``),
        #: stamped on each request as it is handed to the policy; ``None``: none set.
        self.policy_version: int | None = None
        self._prefix = f"req_{os.getpid():x}{int(time.time()) & 0xFFFFFF:x}_"
        # The weight-update fence (core/fence.py): while paused nothing is handed out, and no
        # request times out; the requests handed out and not yet answered or given back; the
        # streamed answers still being sent; whom to tell when either shrinks.
        self.paused = False
        self._paused_wall = 0.0
        self._taken: dict[str, ParkedRequest] = {}
        self.streams_in_flight = 0
        self.on_change: Any = None

    # ------------------------------------------------------------------ agent side

    def hold_bytes(self, session_id: str, nbytes: int) -> None:
        """Count ``nbytes`` of a body being read against the session's byte budget (released with
        :meth:`release_bytes`, or handed to the request by :meth:`park`'s ``held_bytes``).
        Raises :class:`TooManyParkedError` when the session's bodies would pass
        ``max_parked_bytes_per_session``, or every session's together ``max_parked_bytes``, or half of
        it while this session holds more than an equal share of it (:meth:`_fair_share`)."""
        held = self._bytes_by_session.get(session_id, 0)
        if held + nbytes > self.max_parked_bytes_per_session:
            raise TooManyParkedError(
                f"this session's requests waiting for the policy (or being read) hold {held} bytes of body; "
                f"{nbytes} more would pass the gateway's limit of {self.max_parked_bytes_per_session} bytes "
                "per session; retry when one is answered"
            )
        total = self.parked_bytes
        if total + nbytes > self.max_parked_bytes:
            raise TooManyParkedError(
                f"the gateway is full: requests waiting for the policy (or being read) hold {total} "
                "bytes of body "
                f"across all sessions; {nbytes} more would pass its limit of {self.max_parked_bytes} bytes "
                "across sessions; retry after a short wait, as the policy answers"
            )
        if total + nbytes > self.max_parked_bytes / 2 and held + nbytes > self._fair_share(session_id):
            raise TooManyParkedError(
                f"the gateway is over half full ({total} bytes of body held by requests waiting for the "
                f"policy across sessions, limit {self.max_parked_bytes}) and this session holds {held}, "
                f"{nbytes} more would pass an equal share of the limit among the sessions holding any; "
                "retry after a short wait, as the policy answers"
            )
        self._bytes_by_session[session_id] = held + nbytes
        self.parked_bytes = total + nbytes

    def _fair_share(self, session_id: str) -> float:
        """The bytes a session may hold once the gateway is over half full: an equal share of
        ``max_parked_bytes`` among the sessions holding bytes (this one counted).

        Why: past half the budget only sessions under their share may add, so a few sessions parking
        large bodies cannot take the whole budget and push every other session to 429 (an episode
        that fails that way is reward 0, and lowers its group-mates' rewards, which a policy could
        learn). The budget itself stays a hard limit for every session.
        """
        holders = len(self._bytes_by_session) + (session_id not in self._bytes_by_session)
        return self.max_parked_bytes / holders

    def release_bytes(self, session_id: str, nbytes: int) -> None:
        """Give back bytes :meth:`hold_bytes` counted (a body that was refused, or never parked)."""
        if nbytes <= 0:
            return
        held = self._bytes_by_session.get(session_id, 0)
        self.parked_bytes -= min(nbytes, held)
        left = held - nbytes
        if left > 0:
            self._bytes_by_session[session_id] = left
        else:
            self._bytes_by_session.pop(session_id, None)

    def held_bytes_for(self, session_id: str) -> int:
        """Body bytes the session's parked requests (and bodies being read) hold."""
        return self._bytes_by_session.get(session_id, 0)

    def park(
        self,
        session_id: str,
        request: CanonicalRequest,
        endpoint: str,
        *,
        side_call: bool = False,
        raw_body: bytes | None = None,
        held_bytes: int | None = None,
        canonical_json: bytes | None = None,
        encoder: CanonicalEncoder | None = None,
        layout: LayoutHint | None = None,
    ) -> ParkedRequest:
        """Park an agent's request; raises :class:`TooManyParkedError` when its session has
        ``max_parked_per_session`` requests parked already, or its bodies would pass
        ``max_parked_bytes_per_session``; :class:`GatewayClosedError` after close.

        ``held_bytes``: bytes already counted with :meth:`hold_bytes` for this body, which the
        request now holds (without it, ``raw_body``'s length is counted here). ``canonical_json``:
        the canonical form already encoded (as :func:`_canonical_json` does), for ``/poll``;
        ``encoder``: the :class:`CanonicalEncoder` of the request's line, to encode it when polled;
        ``layout``: where the body's list lies in ``raw_body``, as its parse found."""
        if self._closed:
            raise GatewayClosedError("the gateway is shutting down")
        mine = self._parked_by_session.get(session_id)
        count = len(mine) if mine is not None else 0
        if count >= self.max_parked_per_session:
            raise TooManyParkedError(
                f"this session already has {count} requests waiting for the policy "
                f"(the gateway's limit is {self.max_parked_per_session}); retry when one is answered"
            )
        if held_bytes is None:
            held_bytes = len(raw_body) if raw_body is not None else 0
            self.hold_bytes(session_id, held_bytes)
        loop = asyncio.get_running_loop()
        rid = f"{self._prefix}{next(self._ids)}"
        parked = ParkedRequest(
            id=rid,
            session_id=session_id,
            protocol=request.protocol,
            endpoint=endpoint,
            request=request,
            timestamp=time.time(),
            future=loop.create_future(),
            side_call=side_call,
            raw_body=raw_body,
            held_bytes=held_bytes,
            layout=layout,
        )
        if canonical_json is not None:
            parked._canonical = canonical_json
        parked._encoder = encoder
        self._pending[rid] = parked
        if mine is None:
            mine = self._parked_by_session[session_id] = {}
        mine[rid] = parked
        if self.request_timeout > 0:
            parked._expires = expires = loop.time() + self.request_timeout
            if expires < self._timer_at:
                self._arm(expires)
        if self._metrics is not None:
            self._metrics.parked()
        self._make_available(parked)
        return parked

    async def wait(self, parked: ParkedRequest) -> Answer:
        """Wait for the answer. If the waiting handler is cancelled (agent gone), withdraw."""
        try:
            return await parked.future
        except asyncio.CancelledError:
            self.withdraw(parked, "agent disconnected")
            raise

    def withdraw(self, parked: ParkedRequest, reason: str) -> None:
        """Forget a request the agent no longer waits for."""
        if self._pending.get(parked.id) is not parked:
            return
        self._finish(parked, _State.GONE)
        _fail(parked, RequestClosed(reason, 499, reason))
        if self._metrics is not None:
            self._metrics.withdrawn()
        log.debug("withdrew %s: %s", parked.id, reason)

    def _expire(self, parked: ParkedRequest) -> None:
        self._finish(parked, _State.GONE)
        msg = (
            f"the policy did not answer within {self.request_timeout:g} s; "
            "the request timed out at the gateway"
        )
        _fail(parked, RequestClosed("timeout", 504, msg))
        if self._metrics is not None:
            self._metrics.timed_out()

    def close_session(self, session_id: str, reason: str = "session closed") -> int:
        """End every pending request of a session; their agents get an error. Returns how many."""
        victims = list(self._parked_by_session.get(session_id, {}).values())
        for p in victims:
            self._finish(p, _State.GONE)
            _fail(p, RequestClosed("session closed", 503, reason))
        return len(victims)

    def pending_for(self, session_id: str) -> int:
        """How many requests of this session are parked."""
        return len(self._parked_by_session.get(session_id, ()))

    # ------------------------------------------------------------------ policy side

    def take(self, session_id: str | None = None, max_items: int = 1,
             lease: float | None = -1.0) -> list[ParkedRequest]:
        """Lease up to ``max_items`` available requests without waiting.

        ``lease`` -1 means the broker's default; ``None`` means no lease (never redelivered).
        While sampling is paused (the weight-update fence) nothing is handed out.
        """
        if self.paused:
            return []
        if session_id is None:
            source = self._available
        else:
            found = self._available_by_session.get(session_id)
            if not found:
                return []
            source = found
        out: list[ParkedRequest] = []
        while source and len(out) < max_items:
            parked = next(iter(source.values()))
            if parked.future.done():  # its agent's handler was cancelled and has not withdrawn yet
                self.withdraw(parked, "agent disconnected")
                continue
            self._unavail(parked)
            parked._fenced = False
            self._taken[parked.id] = parked
            out.append(parked)
        if out:
            seconds = self.lease_seconds if lease == -1.0 else lease
            until = (asyncio.get_running_loop().time() + seconds if seconds is not None and seconds > 0
                     else None)
            version = self.policy_version
            now = time.time()
            for parked in out:
                parked.taken_at = now
                parked.attempt += 1
                parked._lease_until = until
                parked.policy_version = version
            if until is not None and until < self._timer_at:
                self._arm(until)
        return out

    async def poll(
        self,
        session_id: str | None = None,
        *,
        max_items: int = 1,
        wait: float = 0.0,
        lease: float | None = -1.0,
    ) -> list[ParkedRequest]:
        """Long-poll: return as soon as at least one request is available, or ``[]`` after ``wait``.

        Raises :class:`GatewayClosedError` once the broker is closed, so a polling loop ends
        instead of spinning.
        """
        if self._closed:
            raise GatewayClosedError("the gateway is closed")
        got = self.take(session_id, max_items, lease)
        if got or wait <= 0:
            return got
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:
            if loop.time() + _SLACK >= deadline:
                return []
            # The deadline timer resolves the waiter when its wait is up, rather than
            # asyncio.timeout(): no task cancellation to undo, no timer per poll.
            waiter = _Waiter(session_id, loop.create_future(), deadline)
            self._waiters.append(waiter)
            if deadline < self._timer_at:
                self._arm(deadline)
            try:
                await waiter.future
            finally:
                if not waiter.future.done():
                    waiter.future.cancel()
                try:
                    self._waiters.remove(waiter)
                except ValueError:
                    pass
            if self._closed:
                raise GatewayClosedError("the gateway is closed")
            got = self.take(session_id, max_items, lease)
            if got:
                return got

    def respond(
        self,
        request_id: str,
        answer: AnswerLike,
        *,
        tokens: TokenRecord | dict[str, Any] | None = None,
        policy_version: int | None = None,
    ) -> ParkedRequest:
        """Answer a parked request (anything :func:`~ares_gateway.core.answers.coerce_answer` reads).

        ``policy_version``: the version of the weights that sampled the answer, as its policy reports
        it (checked: a non-negative integer); without it, the turn's version is its completion's
        ``policy_version``, else the gateway's when the request was handed to the policy.

        Raises the :mod:`ares_gateway.core.errors` outcome on failure; an invalid answer leaves the
        request pending."""
        policy_version = read_policy_version(policy_version)
        # Malformed token ids are the caller's error whatever became of the request (400 before 404/409/410);
        # read here once: coerce_answer takes the checked record as it is.
        tokens = read_tokens(tokens)
        parked = self._pending.get(request_id)
        if parked is None:
            state = self._done.get(request_id)
            if state is _State.ANSWERED:
                raise AlreadyAnsweredError(f"request {request_id} was already answered")
            if state is _State.GONE:
                raise RequestGoneError(
                    f"request {request_id} is gone: its agent disconnected, it timed out, or its "
                    "session closed"
                )
            raise UnknownRequestError(f"no request {request_id}; answer ids exactly as /poll returned them")
        if parked.future.done():
            # Its waiter was cancelled (the agent disconnected) in this loop iteration, before the
            # handler's task could run to withdraw it: the request is gone, whatever else is queued.
            self.withdraw(parked, "agent disconnected")
            raise RequestGoneError(f"request {request_id} is gone: its agent disconnected")
        if parked._fenced:
            raise FencedAnswerError(_fenced_message(request_id))
        resolved = coerce_answer(parked.protocol, parked.request, answer, tokens)
        if policy_version is not None:
            parked.policy_version = policy_version
        elif parked.attempt == 0:  # answered without being taken: handed over now
            parked.policy_version = self.policy_version
        if isinstance(resolved, StreamAnswer):
            resolved = StreamAnswer(
                _TrackedStream(self, record_stream(self._on_turn, parked, resolved.source)))
        self._finish(parked, _State.ANSWERED)
        parked.future.set_result(resolved)
        latency = time.time() - parked.timestamp
        if self._metrics is not None:
            self._metrics.answered(latency)
        if isinstance(resolved, Completion):
            record_turn(self._on_turn, parked, resolved, latency)
        elif isinstance(resolved, NativeAnswer):
            record_turn(self._on_turn, parked, resolved.completion, latency)
        return parked

    # ------------------------------------------------------------------ internals

    def _make_available(self, parked: ParkedRequest) -> None:
        if self._taken.pop(parked.id, None) is not None:
            self._given_back(parked)
        self._available[parked.id] = parked
        by = self._available_by_session.get(parked.session_id)
        if by is None:
            by = self._available_by_session[parked.session_id] = {}
        by[parked.id] = parked
        for waiter in self._waiters:
            if (not waiter.future.done()
                and (waiter.session_id is None or waiter.session_id == parked.session_id)):
                waiter.future.set_result(None)
                break

    def _unavail(self, parked: ParkedRequest) -> None:
        if self._available.pop(parked.id, None) is None:
            return
        by = self._available_by_session.get(parked.session_id)
        if by is not None:
            by.pop(parked.id, None)
            if not by:
                del self._available_by_session[parked.session_id]

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = asyncio.get_running_loop().call_at(when, self._on_deadline)

    def _on_deadline(self) -> None:
        """Time out, re-deliver and wake what is due; re-arm for the earliest deadline left."""
        self._timer, self._timer_at = None, math.inf
        if self._closed:
            return
        self.deadline_passes += 1
        now = asyncio.get_running_loop().time()
        due = now + _SLACK
        upcoming = math.inf
        paused = self.paused
        for parked in list(self._pending.values()):
            if not paused:  # a paused fence's time does not count against request_timeout
                if parked._expires <= due:
                    self._expire(parked)
                    continue
                upcoming = min(upcoming, parked._expires)
            until = parked._lease_until
            if until is not None:
                if until <= due:
                    parked._lease_until = None
                    log.info("lease on %s expired after attempt %d; delivering again", parked.id,
                             parked.attempt)
                    self._make_available(parked)
                    if paused:
                        # A pause stops waiting for it; its poller's late answer would land after the
                        # fence, sampled with the old weights: refused, as an abort's would be.
                        parked._fenced = True
                else:
                    upcoming = min(upcoming, until)
        for waiter in self._waiters:
            if waiter.deadline <= due:
                _wake(waiter.future)
            else:
                upcoming = min(upcoming, waiter.deadline)
        if upcoming < math.inf:
            self._arm(max(upcoming, now + len(self._pending) * _GAP_PER_PENDING))

    def _finish(self, parked: ParkedRequest, state: _State) -> None:
        del self._pending[parked.id]
        if self._taken.pop(parked.id, None) is not None:
            self._given_back(parked)
        mine = self._parked_by_session[parked.session_id]
        del mine[parked.id]
        if not mine:
            del self._parked_by_session[parked.session_id]
        held, parked.held_bytes = parked.held_bytes, 0
        self.release_bytes(parked.session_id, held)
        self._unavail(parked)
        parked._lease_until = None
        self._done[parked.id] = state
        if len(self._done) > _TOMBSTONES:
            self._done.popitem(last=False)

    # ------------------------------------------------------------------ weight-update fence

    def _given_back(self, parked: ParkedRequest) -> None:
        parked._owned = False
        if self.on_change is not None:
            self.on_change()

    def _stream_ended(self) -> None:
        self.streams_in_flight -= 1
        if self.on_change is not None:
            self.on_change()

    def pause(self) -> None:
        """Hand nothing out (``take``, ``poll``) and stop the request timeouts' clock until :meth:`resume`."""
        if not self.paused:
            self.paused = True
            self._paused_wall = time.time()

    def resume(self) -> None:
        """Hand requests out again: each pending request's timeout moves by the time it spent parked
        in the pause, and the long-polls waiting wake to take what is available."""
        if not self.paused:
            return
        self.paused = False
        now = time.time()
        earliest = math.inf
        for parked in self._pending.values():
            if parked._expires < math.inf:
                parked._expires += max(0.0, now - max(self._paused_wall, parked.timestamp))
                earliest = min(earliest, parked._expires)
        if earliest < self._timer_at:
            self._arm(earliest)
        for waiter in self._waiters:
            _wake(waiter.future)

    def check_attempt(self, request_id: str, attempt: int) -> None:
        """Refuse (:class:`FencedAnswerError`) an answer for an ``attempt`` of a pending request other than
        its current one: it was leased before an abort fence took it back, and leased again since."""
        parked = self._pending.get(request_id)
        if parked is not None and attempt != parked.attempt:
            raise FencedAnswerError(_fenced_message(request_id, attempt))

    def taken(self) -> list[ParkedRequest]:
        """The requests handed out and not yet answered or given back."""
        return list(self._taken.values())

    def own(self, parked: ParkedRequest) -> None:
        """Mark a taken request as run by an in-process generation of the fence."""
        if self._taken.get(parked.id) is parked:
            parked._owned = True

    def hand_back(self, parked: ParkedRequest) -> None:
        """Give a taken, unanswered request back to the parked ones (its taker stopped)."""
        if self._taken.get(parked.id) is parked and self._pending.get(parked.id) is parked:
            parked._lease_until = None
            self._make_available(parked)

    def take_back_unowned(self) -> int:
        """Abort fence: take back every request handed to a poller or another taker that does not run it
        through the fence; an answer to one is refused until it is taken again. Returns how many."""
        back = [p for p in self._taken.values() if not p._owned]
        for parked in back:
            parked._lease_until = None
            self._make_available(parked)
            parked._fenced = True
        return len(back)

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def pending(self) -> list[ParkedRequest]:
        return list(self._pending.values())

    def close(self) -> None:
        """Fail every pending request (gateway shutting down)."""
        for parked in list(self._pending.values()):
            self._finish(parked, _State.GONE)
            _fail(parked, RequestClosed("shutdown", 503, "the gateway is shutting down"))
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._timer_at = None, math.inf
        for waiter in self._waiters:
            if not waiter.future.done():
                waiter.future.set_result(None)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _fail(parked: ParkedRequest, exc: RequestClosed) -> None:
    if not parked.future.done():
        parked.future.set_exception(exc)
        # Mark the exception retrieved: the agent's handler may already be gone.
        parked.future.exception()


def _fenced_message(request_id: str, attempt: int | None = None) -> str:
    which = f"attempt {attempt} of request {request_id}" if attempt is not None else f"request {request_id}"
    return (f"{which} was taken back by a weight-update fence (mode abort): this answer was sampled with the "
            "old weights and is dropped; the request is delivered again (its next attempt) after the resume")


class _TrackedStream:
    """A streamed answer counted as in flight (for the weight-update fence) until it ends or is closed."""

    __slots__ = ("_broker", "_items", "_open")

    def __init__(self, broker: Broker, source: Any) -> None:
        self._broker = broker
        self._items = aiter(source)
        self._open = True
        broker.streams_in_flight += 1

    def __aiter__(self) -> _TrackedStream:
        return self

    async def __anext__(self) -> Any:
        try:
            return await anext(self._items)
        except BaseException:
            self._end()
            raise

    async def aclose(self) -> None:
        self._end()
        aclose = getattr(self._items, "aclose", None)
        if aclose is not None:
            await aclose()

    def _end(self) -> None:
        if self._open:
            self._open = False
            self._broker._stream_ended()

    def __del__(self) -> None:  # a stream nobody read to its end nor closed (its agent's handler died)
        if self._open:
            self._open = False
            self._broker.streams_in_flight -= 1
