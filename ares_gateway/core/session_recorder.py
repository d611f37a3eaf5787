"""The default recorder: each session's turns, kept incrementally, as training samples and a turn log.

:class:`SessionRecorder` records incrementally and keeps only what is new:

* each turn with a token record goes into the session's message tree (:mod:`trajectory`) as it
  is answered, so samples cost one linearization, never a replay of the session;
* each turn is encoded once into a compact record (:mod:`ares_gateway.core.record_codec`, whose
  docstring is the record's written schema): the native request body as a delta against the
  previous turn of the same line (main line or side calls: the messages it shares with that turn
  are a count, unchanged top-level fields such as ``tools`` and ``system`` a reference), its prompt
  token ids as the tokens beyond those it shares with the previous turn's prompt + output (int32
  bytes, never lists of Python ints), its completion, timing, side-call flag and sampling
  parameters; records over 1 KiB are zlib-compressed;
* the record goes to the durable :class:`~ares_gateway.core.store.TurnStore` when the gateway has a
  data dir, and the turn log (``GET /sessions/{id}/turns``) is decoded from the records.

The session's lifecycle: an ended session's in-memory state is released once its samples are built
(:meth:`SessionRecorder.release`); it is read back from the data dir when asked for again
(:meth:`SessionRecorder._load`), and recording goes on where its records end.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from ares_gateway.core.canonical import CanonicalRequest, Completion, WireProtocol
from ares_gateway.core.record_codec import (
    DECODE_ERRORS,
    LIST_KEYS,
    Decoder,
    Line,
    LostRecordError,
    encode_head,
    encode_tokens,
    encode_use,
    log_entry,
    pack,
)
from ares_gateway.core.recorder import RecordedTurn, token_counts
from ares_gateway.core.store import DamagedRecord, TurnStore, lost_record
from ares_gateway.core.wire import adapter_for
from trajectory import Sample, TrajectoryManager, TurnRecord
from trajectory._tokens import as_token_array, common_prefix_len

log = logging.getLogger(__name__)



class _SessionState:
    __slots__ = ("count", "last_end", "lines", "payloads", "seq")

    def __init__(self) -> None:
        #: When the latest answer recorded so far ended (Unix seconds; the agent's think time starts there).
        self.last_end: float | None = None
        self.lines: dict[bool, Line] = {}
        #: The records, for a recorder without a store (with one, they are read back from it).
        self.payloads: list[tuple[int, bytes]] = []
        self.count = 0
        self.seq = 0


def _prompt_chat(request: CanonicalRequest, line: Line, prev_seq: int | None,
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
    lk = LIST_KEYS.get(request.protocol)
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
               prompt: Any, output: Any, logprobs: Any, finish_reason: str | None, rid: str, side: bool,
               version: int | None = None) -> int | None:
    return tm.record_turn(
        sid,
        prompt_messages=chat,
        response_message=completion.to_message().to_chat_dict() if len(output) else None,
        turn=TurnRecord(
            prompt_ids=prompt,
            output_ids=output,
            output_logprobs=() if logprobs is None else logprobs,
            finish_reason=finish_reason or completion.finish_reason,
            policy_version=version,
        ),
        metadata={"side_call": True, "request_id": rid} if side else {"request_id": rid},
    )


def _version_of(value: Any) -> int | None:
    """A policy version read back from a record or a turn log: anything but a non-negative integer is none."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class TurnLogReader:
    """A session's turn log read as it grows: each :meth:`new` decodes only the records added since the
    last call (the delta decoder keeps its state), where :meth:`SessionRecorder.turn_log` decodes them
    all; for a viewer following a live session on the gateway's event loop. Damaged records are skipped
    (``turn_log`` reports them)."""

    def __init__(self, recorder: SessionRecorder, session_id: str, *, tokens: bool = False) -> None:
        self._recorder = recorder
        self._sid = session_id
        self._tokens = tokens
        self._decoder = Decoder()
        self._last = 0

    def new(self) -> list[dict[str, Any]]:
        """The turn-log entries recorded since the last call, in order."""
        out: list[dict[str, Any]] = []
        for seq, payload in self._recorder._records(self._sid):
            if seq <= self._last:
                continue
            self._last = seq
            try:
                out.append(log_entry(self._decoder.decode(seq, payload), tokens=self._tokens))
            except LostRecordError:
                continue
            except DECODE_ERRORS:
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
            request = adapter_for(WireProtocol(str(entry.get("protocol")))).parse_request(
                entry.get("request"))
            answer = Completion.model_validate({k: v for k, v in completion.items() if k != "tokens"})
        except ValueError as exc:  # a line no gateway wrote: left out, as a damaged record is
            log.warning("turn log: request %s left out of the tree: %s", entry.get("request_id"), exc)
            continue
        logprobs = tokens.get("output_logprobs")
        _tree_turn(tm, sid, [m.to_chat_dict() for m in request.messages], answer,
                   as_token_array(tokens["prompt_ids"], what="prompt_ids"),
                   as_token_array(tokens["output_ids"], what="output_ids"),
                   np.asarray(logprobs, dtype=np.float64) if logprobs else None,
                   tokens.get("finish_reason"), str(entry.get("request_id")), bool(entry.get("side_call")),
                   _version_of(entry.get("policy_version")))
    return tm.tree_view(sid, side_call=side_call)


class SessionRecorder:
    """Records each session's answered turns incrementally; samples and the turn log on demand.

    Args:
        fork_threshold_tokens: passed to the message tree (see :class:`trajectory.TrajectoryManager`).
        store: the durable store the records go to (``None``: memory only, the records kept in
            memory; then :meth:`release` keeps the session, since nothing else has it).
        keyframe_every: every this many records of a line one is stored whole (see
            :func:`encode_head`; 0: only the first), bounding what a damaged record takes with it.
        defer: on an event loop, record each turn at the end of the loop iteration it was answered
            in, after the agent's handler has sent the answer, instead of inside ``respond``: the
            encoding is then off the agent's critical path. Every read (and :meth:`drain`) records
            what waits first, so nothing read ever misses a turn; without a running loop a turn is
            recorded at once.
    """

    def __init__(self, *, fork_threshold_tokens: int = 1024, store: TurnStore | None = None,
                 keyframe_every: int = 128, defer: bool = False) -> None:
        if keyframe_every < 0:
            raise ValueError("keyframe_every must be >= 0")
        self.defer = defer
        self._waiting: deque[RecordedTurn] = deque()
        self._drain_loop: asyncio.AbstractEventLoop | None = None  # the loop a drain() is scheduled on
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
        if self.defer:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                pass
            else:
                if self._waiting and self._drain_loop is not loop:
                    self.drain()  # turns of a loop that ended before it drained them: theirs come first
                # The answered request's handler was woken first (its future was set before this
                # call), so it sends the answer before the loop gets to drain().
                self._waiting.append(turn)
                if len(self._waiting) == 1:
                    self._drain_loop = loop
                    loop.call_soon(self.drain)
                return
        self._record(turn)

    def drain(self) -> None:
        """Record the turns waiting (``defer``), in the order they were answered. A turn that fails
        is logged, never raised: a recorder bug must not break a turn."""
        waiting = self._waiting
        while waiting:
            turn = waiting.popleft()
            try:
                self._record(turn)
            except Exception:
                log.exception("recorder failed for %s", turn.request_id)

    def _record(self, turn: RecordedTurn) -> None:
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
            header, line, key = encode_head(turn, body, state.lines, seq, self.keyframe_every, raw)
            blob = b""
            reused: int | None = None
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
                                        tokens.output_logprobs, tokens.finish_reason, turn.request_id,
                                        turn.side_call, turn.policy_version)
                except Exception as exc:
                    # The turn is recorded whole all the same; the error is raised once it is.
                    tree_error = exc
                    line.tseq = None  # what the tree holds now is not known: the next ids go whole
                    header["tok"], blob = encode_tokens(tokens, prompt, output, line, seq, False, None, None,
                                                        key=True)
                else:
                    prev = None if shared is not None else self._tm.last_ids(sid, side_call=turn.side_call)
                    header["tok"], blob = encode_tokens(tokens, prompt, output, line, seq, shared is not None,
                                                        shared,
                                                       prev, key)
                    # Counted whatever the record's keyframes do: the ids this prompt shares with the
                    # previous stored turn's prompt + output (0 for the first).
                    reused = (shared if shared is not None else common_prefix_len(prev, prompt)
                              if prev is not None else 0)
            header["use"] = self._use(state, turn, reused)
            # Packed before anything is stored: a record that cannot be encoded (a number beyond
            # 64 bits from a Python caller, anything else) is never half written.
            payload = pack(header, blob)
            deps = [b for b in (header["body"].get("base"), header.get("tok", {}).get("base"))
                    if b is not None]
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

    @staticmethod
    def _use(state: _SessionState, turn: RecordedTurn, reused: int | None) -> dict[str, int | float]:
        """The record's ``use``: the turn's token counts and timing, and the agent's think time before it
        (from the latest answer recorded before it arrived; ``None`` when that ended after it arrived)."""
        pt, ct = token_counts(turn.completion)
        last = state.last_end
        think = turn.timestamp - last if last is not None and turn.timestamp >= last else None
        end = turn.timestamp + turn.latency
        state.last_end = end if last is None else max(last, end)
        return encode_use({
            "prompt_tokens": pt, "completion_tokens": ct, "reused_prompt_tokens": reused,
            "parked_seconds": turn.parked_seconds, "policy_seconds": turn.policy_seconds,
            "ttft_seconds": turn.ttft, "think_seconds": think,
        })

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
        self.drain()
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
        self.drain()
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
                log.error("data dir: session %s turn %d could not be read and is skipped: %s", sid, d.seq,
                          d.reason)
            self.damaged.setdefault(sid, []).extend(new)

    def _decoded(self, sid: str) -> list[tuple[int, dict[str, Any]]]:
        dec = Decoder()
        out: list[tuple[int, dict[str, Any]]] = []
        broken: list[DamagedRecord] = []
        for seq, payload in self._records(sid):
            try:
                out.append((seq, dec.decode(seq, payload)))
            except LostRecordError as exc:
                broken.append(DamagedRecord(sid, seq, str(exc)))
            except DECODE_ERRORS as exc:
                broken.append(DamagedRecord(sid, seq, f"cannot be decoded: {exc}"))
        self._report(sid, broken)
        return out

    def turns(self, session_id: str) -> list[dict[str, Any]]:
        """The session's turns as :meth:`turn_log` entries."""
        return self.turn_log(session_id)

    def turn_log(self, session_id: str, *, tokens: bool = True) -> list[dict[str, Any]]:
        """The turn log: native request, canonical completion (with its token record unless
        ``tokens=False``), timing, side-call flag and sampling parameters, in answer order."""
        return [log_entry(d, tokens=tokens) for _, d in self._decoded(session_id)]

    def turn_count(self, session_id: str) -> int:
        self.drain()
        state = self._states.get(session_id)
        if state is not None:
            return state.count
        return len(self._records(session_id))

    def samples(self, session_id: str, *, reward: float = 0.0, max_sample_tokens: int = 0) -> list[Sample]:
        """Training samples of a session's token-recorded turns (turns without token ids are skipped)."""
        self.drain()
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
                       d["finish_reason"], h["rid"], bool(h["side"]), _version_of(h.get("pv")))
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
        tails: dict[Line, tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]] = {}
        for seq, d in decoded:
            h = d["header"]
            if isinstance(h.get("ts"), int | float) and isinstance(h.get("lat"), int | float):
                state.last_end = max(state.last_end or 0.0, h["ts"] + h["lat"])
            line = state.lines.setdefault(bool(d["header"]["side"]), Line())
            if line.follow(seq, d):
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
        self.drain()
        if self.store is None or session_id not in self._states:
            return False
        self.store.flush()
        del self._states[session_id]
        self._tm.drop_session(session_id)
        self._stored.add(session_id)
        return True

    def drop(self, session_id: str) -> None:
        """Forget a session everywhere (memory and, through the caller, the store)."""
        self.drain()
        self._states.pop(session_id, None)
        self._tm.drop_session(session_id)
        self._stored.discard(session_id)
        self.damaged.pop(session_id, None)

    def in_memory(self) -> list[str]:
        """Ids of the sessions whose state is in memory."""
        self.drain()
        return list(self._states)
