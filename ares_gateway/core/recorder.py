"""The recorder's seam: where an answered turn is handed to the gateway's recorder.

This is the one place a turn is recorded: :func:`record_turn` builds a :class:`RecordedTurn` when a
request's whole completion is known and hands it to the gateway's :class:`Recorder`. The broker
calls it at ``respond`` for a whole answer; for a streamed one it wraps the policy's stream in
:func:`record_stream`, which calls it when the stream ends.

What the default recorder does with a turn is in :mod:`ares_gateway.core.session_recorder` (the
sessions' message trees, samples and turn logs, kept incrementally) and
:mod:`ares_gateway.core.record_codec` (the versioned record each turn is stored as).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any, Protocol

import orjson

from ares_gateway.core._body_layout import LayoutHint
from ares_gateway.core.canonical import CanonicalRequest, Completion, CompletionDelta, WireProtocol
from ares_gateway.core.streaming import DeltaAccumulator
from ares_gateway.core.wire import adapter_for

log = logging.getLogger(__name__)


class RecordedTurn:
    """One answered turn, as handed to the recorder.

    A turn that came over HTTP keeps the agent's body as bytes rather than its canonical
    object graph: bytes are a fraction of the memory and invisible to the garbage collector,
    which otherwise re-walks every recorded turn of every session. :attr:`request` parses
    them again on access (a few hundred microseconds for a Claude-Code-sized body).
    """

    __slots__ = (
        "_request",
        "completion",
        "latency",
        "layout",
        "parked_seconds",
        "policy_seconds",
        "policy_version",
        "protocol",
        "raw_body",
        "request_id",
        "session_id",
        "side_call",
        "timestamp",
        "ttft",
    )

    def __init__(
        self,
        *,
        session_id: str,
        request_id: str,
        protocol: WireProtocol,
        completion: Completion,
        side_call: bool,
        timestamp: float,
        latency: float,
        raw_body: bytes | None = None,
        request: CanonicalRequest | None = None,
        layout: LayoutHint | None = None,
        policy_version: int | None = None,
        parked_seconds: float | None = None,
        policy_seconds: float | None = None,
        ttft: float | None = None,
    ) -> None:
        if raw_body is None and request is None:
            raise ValueError("a recorded turn needs the request's body or its canonical form")
        self.session_id = session_id
        self.request_id = request_id
        self.protocol = protocol
        self.completion = completion
        self.side_call = side_call
        self.timestamp = timestamp
        self.latency = latency
        self.raw_body = raw_body
        #: Where the body's list lies in :attr:`raw_body`, as the request's parse found (if known).
        self.layout = layout
        #: The version of the weights that sampled the answer (``None``: none known).
        self.policy_version = policy_version
        #: Seconds the request waited before the policy took it, and from then to its answer's end
        #: (``None``: not known, as for a request answered without being taken).
        self.parked_seconds = parked_seconds
        self.policy_seconds = policy_seconds
        #: Seconds from the request's arrival to the first piece of a streamed answer (``None``: not
        #: streamed).
        self.ttft = ttft
        # Both are kept: a RecordedTurn lives only while it is being recorded (the recorder keeps
        # its compact encoding), and the parsed request saves parsing the body again.
        self._request = request

    @property
    def request(self) -> CanonicalRequest:
        """The canonical request (parsed from :attr:`raw_body` on each access when that is kept)."""
        if self._request is not None:
            return self._request
        assert self.raw_body is not None
        return adapter_for(self.protocol).parse_request(orjson.loads(self.raw_body))

    def native_request(self) -> Any:
        """The request body as the agent sent it (parsed JSON)."""
        if self._request is not None and (self._request.raw or self.raw_body is None):
            return self._request.raw
        assert self.raw_body is not None
        return orjson.loads(self.raw_body)


class Recorder(Protocol):
    """Receives every answered turn, in answer order."""

    def __call__(self, turn: RecordedTurn) -> None: ...


#: Where :func:`record_turn` hands a turn (a :class:`Recorder`, or ``list.append`` in a test).
TurnSink = Callable[[RecordedTurn], None]


class Answered(Protocol):
    """What a turn is recorded from: the parked request that was answered."""

    @property
    def id(self) -> str: ...
    @property
    def session_id(self) -> str: ...
    @property
    def protocol(self) -> WireProtocol: ...
    @property
    def raw_body(self) -> bytes | None: ...
    @property
    def request(self) -> CanonicalRequest: ...
    @property
    def side_call(self) -> bool: ...
    @property
    def timestamp(self) -> float: ...
    @property
    def layout(self) -> LayoutHint | None: ...
    @property
    def policy_version(self) -> int | None: ...
    @property
    def taken_at(self) -> float | None: ...


def token_counts(completion: Completion) -> tuple[int | None, int | None]:
    """A turn's prompt and completion token counts: its token record's where it has one (the
    gateway rendered it), else the ``usage`` its policy reported (an upstream's), else ``None``."""
    tokens = completion.tokens
    if tokens is not None:
        return len(tokens.prompt_ids), len(tokens.output_ids)
    usage = completion.usage
    if usage is not None:
        return usage.input_tokens, usage.output_tokens
    return None, None


def record_turn(sink: TurnSink | None, parked: Answered, completion: Completion, latency: float | None = None,
                ttft: float | None = None) -> None:
    """Record one answered turn (a whole answer, or a stream once it ended) into ``sink``.

    The turn's policy version is the completion's own (the engine's or policy's report), else the
    one the request carries (the answer's, or the gateway's when it was handed to the policy).

    A recorder that raises is logged, never passed on: a recorder bug must not break the agent's turn.
    """
    if sink is None:
        return
    if latency is None:
        latency = time.time() - parked.timestamp
    taken = parked.taken_at
    parked_s = policy_s = None
    if taken is not None:
        # Clamped at 0: the wall clock may step between the request's arrival and its taking.
        parked_s = max(0.0, min(taken - parked.timestamp, latency))
        policy_s = max(0.0, latency - parked_s)
    turn = RecordedTurn(
        session_id=parked.session_id,
        request_id=parked.id,
        protocol=parked.protocol,
        raw_body=parked.raw_body,
        request=parked.request,
        completion=completion,
        side_call=parked.side_call,
        timestamp=parked.timestamp,
        latency=latency,
        layout=parked.layout,
        policy_version=parked.policy_version if completion.policy_version is None
        else completion.policy_version, parked_seconds=parked_s, policy_seconds=policy_s,
        ttft=ttft,
    )
    try:
        sink(turn)
    except Exception:
        log.exception("recorder failed for %s", parked.id)


async def record_stream(
    sink: TurnSink | None, parked: Answered, source: AsyncIterable[CompletionDelta | Completion]
) -> AsyncIterator[CompletionDelta | Completion]:
    """The policy's stream as the agent's handler reads it: its deltas, then always one whole
    :class:`Completion` (the policy's final one, or what the deltas spell out), which is
    recorded as the turn. A stream that fails or is abandoned records nothing."""
    acc = DeltaAccumulator()
    final: Completion | None = None
    ttft: float | None = None
    try:
        async for item in source:
            if isinstance(item, Completion):
                final = item
                break
            if isinstance(item, CompletionDelta):
                acc.add(item)
                if ttft is None:  # the first piece, as it goes to the agent's handler to be sent
                    ttft = max(0.0, time.time() - parked.timestamp)
                yield item
        settled = acc.settle(final)
        if ttft is None:  # a stream of one whole answer: its first byte goes out with it
            ttft = max(0.0, time.time() - parked.timestamp)
        record_turn(sink, parked, settled, ttft=ttft)
        yield settled
    finally:
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()


