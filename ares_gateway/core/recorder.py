"""Recording answered turns and turning them into training samples.

This is the one place a turn is recorded: :func:`record_turn` builds a :class:`RecordedTurn` when a
request's whole completion is known and hands it to the gateway's :class:`Recorder`. The broker
calls it at ``respond`` for a whole answer; for a streamed one it wraps the policy's stream in
:func:`record_stream`, which calls it when the stream ends.

The default, :class:`SessionRecorder`, records incrementally and keeps only what is new:

* each turn with a token record goes into the session's message tree (:mod:`trajectory`) as it
  is answered, so samples cost one linearization, never a replay of the session;
* each turn is encoded once into a compact record (:meth:`SessionRecorder.__call__`): the native request body
  as a delta against the previous turn of the same line (main line or side calls: the messages
  it shares with that turn are a count, unchanged top-level fields such as ``tools`` and
  ``system`` a reference), its prompt token ids as the tokens beyond those it shares with the
  previous turn's prompt + output (int32 bytes, never lists of Python ints), its completion,
  timing, side-call flag and sampling parameters; records over 1 KiB are zlib-compressed;
* the record goes to the durable :class:`~ares_gateway.core.store.TurnStore` when the gateway has a
  data dir, and the turn log (``GET /sessions/{id}/turns``) is decoded from the records.

An ended session's in-memory state is released once its samples are built
(:meth:`SessionRecorder.release`); it is read back from the data dir when asked for again.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import time
import zlib
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import orjson

from ares_gateway.core._body_layout import BodyLayout, continue_layout, layout_of
from ares_gateway.core.canonical import CanonicalRequest, Completion, CompletionDelta, WireProtocol
from ares_gateway.core.store import LOST_KIND, DamagedRecord, TurnStore, lost_record
from ares_gateway.core.streaming import DeltaAccumulator
from ares_gateway.core.wire import adapter_for
from trajectory import Sample, TrajectoryManager, TurnRecord
from trajectory._tokens import as_token_array, common_prefix_len

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


# ---------------------------------------------------------------------------------- encoding

#: The key of each protocol's growing list in a request body.
_LIST_KEYS = {
    WireProtocol.OPENAI_CHAT: "messages",
    WireProtocol.ANTHROPIC_MESSAGES: "messages",
    WireProtocol.OPENAI_RESPONSES: "input",
}
_HEADER = struct.Struct("<I")
_COMPRESS_OVER = 1024
_EMPTY_IDS: npt.NDArray[np.int32] = np.zeros(0, dtype=np.int32)


def _digest(value: Any) -> bytes:
    # 128 bits: a collision would silently splice the wrong message into a reconstructed body.
    # SHA-256 truncated: with the CPU's SHA extensions it is 2-3x faster than BLAKE2 here.
    return hashlib.sha256(orjson.dumps(value, default=str)).digest()[:16]


class _Line:
    """What the next turn of one line (a session's main line, or its side calls) is encoded against.

    For the body: the previous turn's raw body and where its list lies in it; the digests of its
    items (for a body that cannot be compared as bytes); and digests of its other top-level fields. For
    token ids, only which turn the next one's are encoded against: the message tree holds that
    turn's ids (:meth:`~trajectory.TrajectoryManager.last_ids`), and they are compared there.
    """

    __slots__ = ("chat", "chat_seq", "hashes", "kept", "layout", "seq", "since_key", "top", "tseq")

    def __init__(self) -> None:
        self.seq: int | None = None
        #: The turn whose prompt + output ids the next turn's token ids are encoded against: the
        #: last one the message tree stored (``None``: none, or the tree and the records disagree).
        self.tseq: int | None = None
        self.since_key = 0  # records on this line since its last keyframe (one stored whole)
        self.hashes: list[bytes] = []
        self.top: dict[str, bytes] = {}
        #: The previous turn's raw body and where its list's items lie in it (when it came as bytes).
        self.layout: BodyLayout | None = None
        #: How many leading items the last body's list shared with the one before it, every other
        #: field the same (-1: not so).
        self.kept = -1
        #: The chat dicts of the prompt messages handed to the message tree at turn ``chat_seq``.
        self.chat: list[dict[str, Any]] | None = None
        self.chat_seq: int | None = None


def _list_delta(items: list[Any], line: _Line, fresh: bool) -> int:
    """How many leading items the list shares with the previous turn's (``line``, whose item
    digests then become this list's), compared digest by digest.

    For a body the raw-bytes path (:func:`continue_layout`) cannot take: the first of a line, one
    changed before its list (or after a restart), one without raw bytes.
    """
    hashes = [_digest(x) for x in items]
    old = [] if fresh else line.hashes
    keep = 0
    limit = min(len(old), len(hashes))
    while keep < limit and old[keep] == hashes[keep]:
        keep += 1
    line.hashes = hashes
    return keep


def _body_delta(protocol: WireProtocol, body: dict[str, Any], line: _Line, seq: int, key: bool = False,
                raw: bytes | None = None) -> dict[str, Any]:
    """The body as a delta against the line's previous turn (``raw``: the bytes it was parsed from)."""
    lk = _LIST_KEYS.get(protocol)
    items = body.get(lk) if lk is not None else None
    if not isinstance(items, list):
        lk, items = None, None
    # The shared history from the raw bytes, when the previous turn's layout is at hand (the common
    # case: its cost does not grow with the history); else from the parsed body.
    shared = None
    if lk is not None and items is not None and raw is not None and line.layout is not None:
        shared = continue_layout(line.layout, raw, lk, len(items))
    if shared is not None and shared[2]:
        top = line.top  # every byte outside the list as before: so is every other field
    else:
        top = {k: _digest(v) for k, v in body.items() if k != lk}
    delta: dict[str, Any] = {"keys": list(body)}
    changed = [k for k, h in top.items() if line.top.get(k) != h]
    # Whether every field but the list is as the previous turn had it (a keyframe stores them anyway).
    same_top = line.seq is not None and not changed and top.keys() == line.top.keys()
    if line.seq is not None and not key:
        delta["base"] = line.seq
        delta["set"] = {k: body[k] for k in changed}
    else:
        delta["set"] = {k: body[k] for k in top}
    if lk is not None and items is not None:
        if shared is not None:
            keep, line.layout, _ = shared
            del line.hashes[keep:]
            line.hashes.extend(_digest(x) for x in items[keep:])
        else:
            keep = _list_delta(items, line, fresh=line.seq is None)
            line.layout = None if raw is None else layout_of(raw, lk, len(items))
        line.kept = keep if same_top else -1
        if key:
            keep = 0  # the line's state moves on as usual; the record holds the whole list
        delta["lk"] = lk
        delta["keep"] = keep
        delta["new"] = items[keep:]
    else:
        line.hashes, line.layout = [], None
    line.top = top
    line.seq = seq
    return delta


def _token_delta(tokens: Any, prompt: npt.NDArray[np.int32], output: npt.NDArray[np.int32], line: _Line,
                 seq: int, stored: bool, shared: int | None, prev: npt.NDArray[np.int32] | None,
                 key: bool = False) -> tuple[dict[str, Any], bytes]:
    """The token ids as the ids beyond those the prompt shares with the prompt + output of turn
    ``line.tseq``: ``shared`` of them when the message tree counted it, else compared with ``prev``
    (those ids) in place. ``stored``: the tree stored this turn, so the next is encoded against it."""
    tseq = None if key or (shared is None and prev is None) else line.tseq
    if tseq is None:
        keep = 0
    elif shared is not None:
        keep = shared
    else:
        assert prev is not None
        keep = common_prefix_len(prev, prompt)
    # float64, as the policy gave them: the turn log returns each logprob exactly (8 bytes an output token).
    lps = np.asarray(tokens.output_logprobs, dtype=np.float64)
    has_lp = bool(lps.shape[0])
    head = {
        "base": tseq,
        "keep": keep,
        "ns": int(prompt.shape[0]) - keep,
        "no": int(output.shape[0]),
        "lp": has_lp,
        "fr": tokens.finish_reason,
        "st": stored,
    }
    if stored:
        line.tseq = seq
    blob = prompt[keep:].astype("<i4").tobytes() + output.astype("<i4").tobytes()
    if has_lp:
        blob += lps.astype("<f8").tobytes()
    return head, blob


def _head(turn: RecordedTurn, body: dict[str, Any], lines: dict[bool, _Line], seq: int, keyframe_every: int,
          raw: bytes | None) -> tuple[dict[str, Any], _Line, bool]:
    """A turn's record but for its token ids: the header, with the body delta-encoded against the
    previous turn of its line (updated; ``raw``: the bytes ``body`` was parsed from). Every
    ``keyframe_every``-th record of a line (0: only the first) is a keyframe, stored whole, so a
    damaged record makes at most the records up to the next keyframe unreadable."""
    line = lines.setdefault(turn.side_call, _Line())
    key = line.seq is None or 0 < keyframe_every <= line.since_key
    line.since_key = 1 if key else line.since_key + 1
    comp = turn.completion.model_dump(mode="json", exclude_none=True, exclude={"tokens"})
    header: dict[str, Any] = {
        "rid": turn.request_id,
        "proto": turn.protocol.value,
        "side": turn.side_call,
        "ts": turn.timestamp,
        "lat": turn.latency,
        "body": _body_delta(turn.protocol, body, line, seq, key, raw),
        "completion": comp,
    }
    request = turn._request
    if request is not None:
        header["sampling"] = request.sampling.model_dump(mode="json", exclude_none=True, exclude_defaults=True)
    return header, line, key


def _pack(header: dict[str, Any], blob: bytes) -> bytes:
    head = orjson.dumps(header, default=str)
    inner = _HEADER.pack(len(head)) + head + blob
    if len(inner) > _COMPRESS_OVER:
        return b"Z" + zlib.compress(inner, 1)
    return b"R" + inner


class LostRecordError(ValueError):
    """A tombstone: the turn was answered, and its record could not be encoded or stored."""


class _Decoder:
    """Reads a session's records in order, keeping each line's previous body and token ids."""

    def __init__(self) -> None:
        self.bodies: dict[bool, tuple[int, dict[str, Any]]] = {}
        self.full: dict[bool, tuple[int, npt.NDArray[np.int32]]] = {}

    def decode(self, seq: int, payload: bytes) -> dict[str, Any]:
        kind, data = payload[:1], payload[1:]
        if kind == LOST_KIND:
            info = orjson.loads(data)
            raise LostRecordError(f"not recorded: {info.get('lost') if isinstance(info, dict) else info}")
        if kind == b"Z":
            data = zlib.decompress(data)
        elif kind != b"R":
            raise ValueError(f"unknown record kind {kind!r}")
        (n,) = _HEADER.unpack_from(data)
        header = orjson.loads(data[4 : 4 + n])
        blob = memoryview(data)[4 + n :]
        side = bool(header["side"])
        delta = header["body"]
        prev: dict[str, Any] | None = None
        if "base" in delta:
            got = self.bodies.get(side)
            if got is None or got[0] != delta["base"]:
                raise ValueError(f"the record it continues (turn {delta['base']}) is missing")
            prev = got[1]
        body: dict[str, Any] = {}
        lk = delta.get("lk")
        for k in delta["keys"]:
            if k == lk:
                kept = prev.get(k, []) if prev is not None else []
                body[k] = kept[: delta["keep"]] + delta["new"]
            elif k in delta["set"]:
                body[k] = delta["set"][k]
            elif prev is not None and k in prev:
                body[k] = prev[k]
            else:
                raise ValueError(f"field {k!r} is neither in the record nor in the one it continues")
        self.bodies[side] = (seq, body)
        completion: dict[str, Any] = header["completion"]
        tok = header.get("tok")
        prompt = output = None
        logprobs: npt.NDArray[np.float64] | None = None
        if tok is not None:
            keep, ns, no = tok["keep"], tok["ns"], tok["no"]
            if len(blob) != 4 * (ns + no) + (8 * no if tok["lp"] else 0):
                raise ValueError("the token ids are cut short")
            suffix = np.frombuffer(blob, dtype="<i4", count=ns).astype(np.int32)
            output = np.frombuffer(blob, dtype="<i4", count=no, offset=4 * ns).astype(np.int32)
            if tok["lp"]:
                logprobs = np.frombuffer(blob, dtype="<f8", count=no, offset=4 * (ns + no)).astype(np.float64)
            base = _EMPTY_IDS
            if tok["base"] is not None:
                got_ids = self.full.get(side)
                if got_ids is None or got_ids[0] != tok["base"]:
                    raise ValueError(f"the token ids it continues (turn {tok['base']}) are missing")
                base = got_ids[1]
            if keep > base.shape[0]:
                raise ValueError("the token ids it continues are cut short")
            prompt = np.concatenate([base[:keep], suffix])
            if tok.get("st", True):  # the turn the next is encoded against (every one, before "st")
                self.full[side] = (seq, np.concatenate([prompt, output]))
        return {
            "header": header,
            "body": body,
            "completion": completion,
            "prompt_ids": prompt,
            "output_ids": output,
            "logprobs": logprobs,
            "finish_reason": None if tok is None else tok["fr"],
        }


def _log_entry(d: dict[str, Any], *, tokens: bool) -> dict[str, Any]:
    h = d["header"]
    completion = dict(d["completion"])
    if tokens and d["prompt_ids"] is not None:
        rec: dict[str, Any] = {
            "prompt_ids": d["prompt_ids"].tolist(),
            "output_ids": d["output_ids"].tolist(),
            "output_logprobs": [] if d["logprobs"] is None else [float(x) for x in d["logprobs"].tolist()],
        }
        if d["finish_reason"] is not None:
            rec["finish_reason"] = d["finish_reason"]
        completion["tokens"] = rec
    entry = {
        "request_id": h["rid"],
        "protocol": h["proto"],
        "side_call": h["side"],
        "timestamp": h["ts"],
        "latency": h["lat"],
        "request": d["body"],
        "completion": completion,
    }
    if "sampling" in h:
        entry["sampling"] = h["sampling"]
    return entry


# ---------------------------------------------------------------------------------- the recorder


class _SessionState:
    __slots__ = ("count", "lines", "payloads", "seq")

    def __init__(self) -> None:
        self.lines: dict[bool, _Line] = {}
        #: The records, for a recorder without a store (with one, they are read back from it).
        self.payloads: list[tuple[int, bytes]] = []
        self.count = 0
        self.seq = 0


def _prompt_chat(request: CanonicalRequest, line: _Line, prev_seq: int | None,
                 body: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The request's messages as chat dicts for the message tree.

    When the body kept the previous turn's first items and every other field, and that turn's chat
    dicts are at hand, the messages those items gave are those dicts again: each protocol reads an
    item into messages on its own, except that an item may fold into the message just before it (a
    Responses ``function_call`` into its assistant message). The messages the other items add are
    counted by reading those items alone, a count never below what they add in context; all the
    messages before them but the last are reused (the very objects: the tree then matches them by
    identity) and only the rest is converted, which keeps a long session's cost per turn flat.
    """
    msgs = request.messages
    prev = line.chat
    lk = _LIST_KEYS.get(request.protocol)
    items = body.get(lk) if body is not None and lk is not None else None
    if (prev is None or prev_seq is None or line.chat_seq != prev_seq or line.kept <= 0 or body is None
            or lk is None or not isinstance(items, list)):
        return [m.to_chat_dict() for m in msgs]
    tail = {k: body[k] for k in ("model", "max_tokens") if k in body} | {lk: items[line.kept :]}
    try:
        added = len(adapter_for(request.protocol).parse_request(tail).messages)
    except Exception:  # the items alone are no valid request (or anything else): convert them all
        return [m.to_chat_dict() for m in msgs]
    reuse = min(len(msgs) - added, len(prev)) - 1
    if 0 <= reuse <= len(msgs):
        return prev[:reuse] + [m.to_chat_dict() for m in msgs[reuse:]]
    return [m.to_chat_dict() for m in msgs]


def _tree_turn(tm: TrajectoryManager, sid: str, chat: list[dict[str, Any]], completion: Completion,
               prompt: Any, output: Any, logprobs: Any, finish_reason: str | None, rid: str, side: bool) -> int | None:
    return tm.record_turn(
        sid,
        prompt_messages=chat,
        response_message=completion.to_message().to_chat_dict() if len(output) else None,
        turn=TurnRecord(
            prompt_ids=prompt,
            output_ids=output,
            output_logprobs=() if logprobs is None else logprobs,
            finish_reason=finish_reason or completion.finish_reason,
        ),
        metadata={"side_call": True, "request_id": rid} if side else {"request_id": rid},
    )


class TurnLogReader:
    """A session's turn log read as it grows: each :meth:`new` decodes only the records added since the
    last call (the delta decoder keeps its state), where :meth:`SessionRecorder.turn_log` decodes them
    all; for a viewer following a live session on the gateway's event loop. Damaged records are skipped
    (``turn_log`` reports them)."""

    def __init__(self, recorder: SessionRecorder, session_id: str, *, tokens: bool = False) -> None:
        self._recorder = recorder
        self._sid = session_id
        self._tokens = tokens
        self._decoder = _Decoder()
        self._last = 0

    def new(self) -> list[dict[str, Any]]:
        """The turn-log entries recorded since the last call, in order."""
        out: list[dict[str, Any]] = []
        for seq, payload in self._recorder._records(self._sid):
            if seq <= self._last:
                continue
            self._last = seq
            try:
                out.append(_log_entry(self._decoder.decode(seq, payload), tokens=self._tokens))
            except (LostRecordError, ValueError, KeyError, TypeError, zlib.error, struct.error):
                continue
        return out


def tree_view_of_turn_log(entries: Iterable[dict[str, Any]], *, side_call: bool = False,
                          fork_threshold_tokens: int = 1024) -> dict[str, Any] | None:
    """The message tree of a turn log (:meth:`SessionRecorder.turn_log` entries with their token records,
    as a run's ``turns/*.jsonl`` holds them), rebuilt as the recorder built it, as plain data
    (:meth:`trajectory.TrajectoryManager.tree_view`); ``None`` when no turn had token ids. Entries
    without a token record (a failed policy call, a scripted answer) are skipped, as the recorder skips
    them, so the tree's turn ids are the samples' ``turn_ids``."""
    tm = TrajectoryManager(fork_threshold_tokens=fork_threshold_tokens)
    sid = "turn-log"
    for entry in entries:
        completion = entry.get("completion")
        if not isinstance(completion, dict):
            continue  # a failed policy call
        tokens = completion.get("tokens")
        if not isinstance(tokens, dict) or tokens.get("output_ids") is None:
            continue
        try:
            request = adapter_for(WireProtocol(str(entry.get("protocol")))).parse_request(entry.get("request"))
            answer = Completion.model_validate({k: v for k, v in completion.items() if k != "tokens"})
        except ValueError as exc:  # a line no gateway wrote: left out, as a damaged record is
            log.warning("turn log: request %s left out of the tree: %s", entry.get("request_id"), exc)
            continue
        logprobs = tokens.get("output_logprobs")
        _tree_turn(tm, sid, [m.to_chat_dict() for m in request.messages], answer,
                   as_token_array(tokens["prompt_ids"], what="prompt_ids"),
                   as_token_array(tokens["output_ids"], what="output_ids"),
                   np.asarray(logprobs, dtype=np.float64) if logprobs else None,
                   tokens.get("finish_reason"), str(entry.get("request_id")), bool(entry.get("side_call")))
    return tm.tree_view(sid, side_call=side_call)


class SessionRecorder:
    """Records each session's answered turns incrementally; samples and the turn log on demand.

    Args:
        fork_threshold_tokens: passed to the message tree (see :class:`trajectory.TrajectoryManager`).
        store: the durable store the records go to (``None``: memory only, the records kept in
            memory; then :meth:`release` keeps the session, since nothing else has it).
        keyframe_every: every this many records of a line one is stored whole (see
            :func:`_head`; 0: only the first), bounding what a damaged record takes with it.
    """

    def __init__(self, *, fork_threshold_tokens: int = 1024, store: TurnStore | None = None,
                 keyframe_every: int = 128) -> None:
        if keyframe_every < 0:
            raise ValueError("keyframe_every must be >= 0")
        self.fork_threshold_tokens = fork_threshold_tokens
        self.keyframe_every = keyframe_every
        self.store = store
        self._tm = TrajectoryManager(fork_threshold_tokens=fork_threshold_tokens)
        self._states: dict[str, _SessionState] = {}
        #: Sessions with records in the store that are not loaded into memory.
        self._stored: set[str] = set()
        #: Records that could not be read back, per session (reported, skipped).
        self.damaged: dict[str, list[DamagedRecord]] = {}
        self._lost_seen = 0  # the store's lost_version last acted on

    # ------------------------------------------------------------------ write

    def __call__(self, turn: RecordedTurn) -> None:
        sid = turn.session_id
        store = self.store
        if store is not None and store.lost_version != self._lost_seen:
            self._forget_lost(store)
        state = self._states.get(sid)
        if state is None:
            state = self._load(sid) if sid in self._stored else None
            if state is None:
                state = self._states[sid] = _SessionState()
        state.seq += 1
        seq = state.seq
        tree_error: Exception | None = None
        try:
            request = turn.request
            body = turn.native_request()
            if not isinstance(body, dict):
                body = {"body": body}
                raw = None
            else:
                raw = turn.raw_body  # the bytes ``body`` was parsed from, when the turn came over HTTP
            tokens = turn.completion.tokens
            line = state.lines.get(turn.side_call)
            prev_seq = None if line is None else line.seq
            header, line, key = _head(turn, body, state.lines, seq, self.keyframe_every, raw)
            blob = b""
            if tokens is not None:
                # int32 arrays already (respond checked them): the record and the tree share them.
                prompt = as_token_array(tokens.prompt_ids, what="prompt_ids")
                output = as_token_array(tokens.output_ids, what="output_ids")
                # The token ids are encoded against the message tree's copy of the last turn it stored,
                # and it counts the ids a stored turn shares with that one (the only pass over them).
                shared: int | None = None
                try:
                    chat = _prompt_chat(request, line, prev_seq, body)
                    line.chat, line.chat_seq = chat, seq
                    shared = _tree_turn(self._tm, sid, chat, turn.completion, prompt, output,
                                        tokens.output_logprobs, tokens.finish_reason, turn.request_id, turn.side_call)
                except Exception as exc:
                    # The turn is recorded whole all the same; the error is raised once it is.
                    tree_error = exc
                    line.tseq = None  # what the tree holds now is not known: the next ids go whole
                    header["tok"], blob = _token_delta(tokens, prompt, output, line, seq, False, None, None, key=True)
                else:
                    prev = None if shared is not None else self._tm.last_ids(sid, side_call=turn.side_call)
                    header["tok"], blob = _token_delta(tokens, prompt, output, line, seq, shared is not None, shared,
                                                       prev, key)
            # Packed before anything is stored: a record that cannot be encoded (a number beyond
            # 64 bits from a Python caller, anything else) is never half written.
            payload = _pack(header, blob)
            deps = [b for b in (header["body"].get("base"), header.get("tok", {}).get("base")) if b is not None]
        except Exception as exc:
            # The lines' state may have moved on to this turn: they start afresh, so the next
            # record of the session is whole and never continues this one, which is a tombstone.
            state.lines.clear()
            payload, deps = lost_record(f"it could not be encoded ({type(exc).__name__}: {exc})"), []
            log.exception("recorder: session %s turn %d could not be encoded; recorded as lost", sid, seq)
        state.count += 1
        if store is not None:
            # The data dir has the record; memory keeps only what the next turn is encoded against.
            store.put_turn(sid, seq, payload, deps)
        else:
            state.payloads.append((seq, payload))
        if tree_error is not None:
            raise tree_error

    def _forget_lost(self, store: TurnStore) -> None:
        """Records the store lost (a failed write): those sessions' lines start afresh, so that no
        later record is a delta against a record the data dir does not have."""
        self._lost_seen = store.lost_version
        for sid, _ in store.drain_lost():
            state = self._states.get(sid)
            if state is not None:
                state.lines.clear()

    def detach_store(self) -> None:
        """Stop writing to the store (the gateway is closing it): the records of the sessions in
        memory are read back first, so their turn log stays available."""
        if self.store is None:
            return
        for sid, state in self._states.items():
            state.payloads = self._records(sid)
        self.store = None

    def known(self, session_ids: set[str]) -> None:
        """Sessions whose records are in the store (read back on first use)."""
        self._stored |= session_ids

    # ------------------------------------------------------------------ read

    def _records(self, sid: str) -> list[tuple[int, bytes]]:
        state = self._states.get(sid)
        if self.store is None:
            return state.payloads if state is not None else []
        if state is None and sid not in self._stored:
            return []
        self.store.flush()
        rows, damaged = self.store.load_turns(sid)
        self._report(sid, damaged)
        return rows

    def _report(self, sid: str, damaged: list[DamagedRecord]) -> None:
        if damaged:
            old = {d.seq for d in self.damaged.get(sid, [])}
            new = [d for d in damaged if d.seq not in old]
            for d in new:
                log.error("data dir: session %s turn %d could not be read and is skipped: %s", sid, d.seq, d.reason)
            self.damaged.setdefault(sid, []).extend(new)

    def _decoded(self, sid: str) -> list[tuple[int, dict[str, Any]]]:
        dec = _Decoder()
        out: list[tuple[int, dict[str, Any]]] = []
        broken: list[DamagedRecord] = []
        for seq, payload in self._records(sid):
            try:
                out.append((seq, dec.decode(seq, payload)))
            except LostRecordError as exc:
                broken.append(DamagedRecord(sid, seq, str(exc)))
            except (ValueError, KeyError, TypeError, zlib.error, struct.error, orjson.JSONDecodeError) as exc:
                broken.append(DamagedRecord(sid, seq, f"cannot be decoded: {exc}"))
        self._report(sid, broken)
        return out

    def turns(self, session_id: str) -> list[dict[str, Any]]:
        """The session's turns as :meth:`turn_log` entries."""
        return self.turn_log(session_id)

    def turn_log(self, session_id: str, *, tokens: bool = True) -> list[dict[str, Any]]:
        """The turn log: native request, canonical completion (with its token record unless
        ``tokens=False``), timing, side-call flag and sampling parameters, in answer order."""
        return [_log_entry(d, tokens=tokens) for _, d in self._decoded(session_id)]

    def turn_count(self, session_id: str) -> int:
        state = self._states.get(session_id)
        if state is not None:
            return state.count
        return len(self._records(session_id))

    def samples(self, session_id: str, *, reward: float = 0.0, max_sample_tokens: int = 0) -> list[Sample]:
        """Training samples of a session's token-recorded turns (turns without token ids are skipped)."""
        if session_id in self._states:
            return self._tm.samples(session_id, reward=reward, max_sample_tokens=max_sample_tokens)
        if session_id not in self._stored:
            return []
        # Released (or not yet loaded): rebuild its tree from the data dir, and let it go again.
        tm = TrajectoryManager(fork_threshold_tokens=self.fork_threshold_tokens)
        self._replay(session_id, tm)
        return tm.get_trajectory(session_id, reward=reward, max_sample_tokens=max_sample_tokens)

    def tree_view(self, session_id: str, *, side_call: bool = False) -> dict[str, Any] | None:
        """The session's message tree as plain data (:meth:`trajectory.TrajectoryManager.tree_view`),
        rebuilt from its records into a private tree, so the live one is never touched."""
        tm = TrajectoryManager(fork_threshold_tokens=self.fork_threshold_tokens)
        self._replay(session_id, tm)
        return tm.tree_view(session_id, side_call=side_call)

    # ------------------------------------------------------------------ memory

    def _replay(self, sid: str, tm: TrajectoryManager) -> list[tuple[int, dict[str, Any]]]:
        decoded = self._decoded(sid)
        for _, d in decoded:
            if d["prompt_ids"] is None:
                continue
            h = d["header"]
            proto = WireProtocol(h["proto"])
            try:
                request = adapter_for(proto).parse_request(d["body"])
                completion = Completion.model_validate(d["completion"])
            except ValueError as exc:
                self._report(sid, [DamagedRecord(sid, int(h.get("seq", 0)), f"cannot be replayed: {exc}")])
                continue
            _tree_turn(tm, sid, [m.to_chat_dict() for m in request.messages], completion, d["prompt_ids"],
                       d["output_ids"], d["logprobs"],
                       d["finish_reason"], h["rid"], bool(h["side"]))
        return decoded

    def _load(self, sid: str) -> _SessionState | None:
        """Bring a stored session back into memory, to record more turns into it."""
        if self.store is None:
            return None
        decoded = self._replay(sid, self._tm)
        state = self._states[sid] = _SessionState()
        state.count = len(decoded)
        damaged = self.damaged.get(sid, [])
        state.seq = max([seq for seq, _ in decoded] + [d.seq for d in damaged], default=0)
        # The lines' delta state, as the encoder left it after the last record.
        tails: dict[_Line, tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]] = {}
        for seq, d in decoded:
            h = d["header"]
            line = state.lines.setdefault(bool(h["side"]), _Line())
            body = d["body"]
            lk = h["body"].get("lk")
            line.seq = seq
            line.since_key = 1 if "base" not in h["body"] else line.since_key + 1
            line.top = {k: _digest(v) for k, v in body.items() if k != lk}
            if lk:
                _list_delta(body[lk], line, fresh=True)
            else:
                line.hashes = []
            if d["prompt_ids"] is not None and h["tok"].get("st", True):
                line.tseq = seq
                tails[line] = (d["prompt_ids"], d["output_ids"])
        # The tree rebuilt by the replay must hold, as its last turn, the ids the records end on.
        for side, line in state.lines.items():
            held = self._tm.last_ids(sid, side_call=side)
            want = tails.get(line)
            if want is None or held is None or not np.array_equal(held, np.concatenate(want)):
                line.tseq = None
        return state

    def release(self, session_id: str) -> bool:
        """Free a session's in-memory state; the data dir keeps it (a memory-only recorder keeps it
        too, since nothing else has it). Returns whether anything was freed."""
        if self.store is None or session_id not in self._states:
            return False
        self.store.flush()
        del self._states[session_id]
        self._tm.drop_session(session_id)
        self._stored.add(session_id)
        return True

    def drop(self, session_id: str) -> None:
        """Forget a session everywhere (memory and, through the caller, the store)."""
        self._states.pop(session_id, None)
        self._tm.drop_session(session_id)
        self._stored.discard(session_id)
        self.damaged.pop(session_id, None)

    def in_memory(self) -> list[str]:
        """Ids of the sessions whose state is in memory."""
        return list(self._states)
