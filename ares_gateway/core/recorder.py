"""Recording answered turns and turning them into training samples.

This is the one place a turn is recorded: :func:`record_turn` builds a :class:`RecordedTurn` when a
request's whole completion is known and hands it to the gateway's :class:`Recorder`. The broker
calls it at ``respond`` for a whole answer; for a streamed one it wraps the policy's stream in
:func:`record_stream`, which calls it when the stream ends. The default,
:class:`SessionRecorder`, keeps each session's turns (the agent's body bytes and
the completion) and builds the session's message tree in :mod:`trajectory` only
when samples are asked for, so the request path does no conversion work.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any, Protocol

import orjson

from ares_gateway.core.canonical import CanonicalRequest, Completion, CompletionDelta, WireProtocol
from ares_gateway.core.streaming import DeltaAccumulator
from ares_gateway.protocols import get_adapter
from trajectory import Sample, TrajectoryManager, TurnRecord

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
        "protocol",
        "raw_body",
        "request_id",
        "session_id",
        "side_call",
        "timestamp",
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
        self._request = None if raw_body is not None else request

    @property
    def request(self) -> CanonicalRequest:
        """The canonical request (parsed from :attr:`raw_body` on each access when that is kept)."""
        if self._request is not None:
            return self._request
        assert self.raw_body is not None
        return get_adapter(self.protocol).parse_request(orjson.loads(self.raw_body))

    def native_request(self) -> Any:
        """The request body as the agent sent it (parsed JSON)."""
        return orjson.loads(self.raw_body) if self.raw_body is not None else self.request.raw


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


def record_turn(sink: TurnSink | None, parked: Answered, completion: Completion, latency: float | None = None) -> None:
    """Record one answered turn (a whole answer, or a stream once it ended) into ``sink``.

    A recorder that raises is logged, never passed on: a recorder bug must not break the agent's turn.
    """
    if sink is None:
        return
    if latency is None:
        latency = time.time() - parked.timestamp
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
    try:
        async for item in source:
            if isinstance(item, Completion):
                final = item
                break
            if isinstance(item, CompletionDelta):
                acc.add(item)
                yield item
        settled = acc.settle(final)
        record_turn(sink, parked, settled)
        yield settled
    finally:
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()


class SessionRecorder:
    """Keeps each session's answered turns; linearizes them on demand."""

    def __init__(self, *, fork_threshold_tokens: int = 1024) -> None:
        self.fork_threshold_tokens = fork_threshold_tokens
        self._turns: dict[str, list[RecordedTurn]] = {}

    def __call__(self, turn: RecordedTurn) -> None:
        self._turns.setdefault(turn.session_id, []).append(turn)

    def turns(self, session_id: str) -> list[RecordedTurn]:
        return list(self._turns.get(session_id, ()))

    def drop(self, session_id: str) -> None:
        self._turns.pop(session_id, None)

    def samples(self, session_id: str, *, reward: float = 0.0, max_sample_tokens: int = 0) -> list[Sample]:
        """Training samples of a session's token-recorded turns (turns without token ids are skipped)."""
        tm = TrajectoryManager(fork_threshold_tokens=self.fork_threshold_tokens)
        for t in self._turns.get(session_id, ()):
            tokens = t.completion.tokens
            if tokens is None:
                continue
            tm.record_turn(
                session_id,
                prompt_messages=[m.to_chat_dict() for m in t.request.messages],
                response_message=t.completion.to_message().to_chat_dict() if tokens.output_ids else None,
                turn=TurnRecord(
                    prompt_ids=tokens.prompt_ids,
                    output_ids=tokens.output_ids,
                    output_logprobs=tokens.output_logprobs,
                    finish_reason=tokens.finish_reason or t.completion.finish_reason,
                ),
                metadata={"side_call": True, "request_id": t.request_id} if t.side_call else {"request_id": t.request_id},
            )
        if not tm.has_session(session_id):
            return []
        return tm.get_trajectory(session_id, reward=reward, max_sample_tokens=max_sample_tokens)

    def turn_log(self, session_id: str) -> list[dict[str, Any]]:
        """The raw turn log: native request, canonical completion, timing, side-call flag."""
        return [
            {
                "request_id": t.request_id,
                "protocol": t.protocol.value,
                "side_call": t.side_call,
                "timestamp": t.timestamp,
                "latency": t.latency,
                "request": t.native_request(),
                "completion": t.completion.model_dump(mode="json", exclude_none=True),
            }
            for t in self._turns.get(session_id, ())
        ]
