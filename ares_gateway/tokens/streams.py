"""Per-session token streams: each turn's prompt extends an earlier turn's exact tokens.

A request is matched to the deepest recorded turn whose conversation (its prompt messages followed
by the answer it produced) the request's messages continue, compared by the trajectory tree's
structural message key (:func:`trajectory.message_key`: role, content, tool calls; wire ids,
cache hints and reasoning ignored). Its prompt is then that turn's prompt ids + sampled output ids
+ the new messages rendered incrementally (:meth:`ChatRenderer.bridge`), so main-line drift is
impossible by construction and the history is never re-tokenized.

When nothing matches although the session has turns (the agent compacted or dropped history, or
made a side call), or the renderer refuses the extension (a template that is not append-only for
this history), a *fresh* render starts a new stream; :class:`StreamStats` counts them with the
reason, and :attr:`Prepared.mode` tells the caller.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ares_gateway.core.canonical import Message, Tool
from ares_gateway.tokens.renderer import ChatRenderer
from trajectory import message_key

__all__ = ["Prepared", "StreamStats", "TokenStreams"]

Mode = Literal["first", "extend", "fresh"]


@dataclass
class StreamStats:
    """Counters of one session's streams."""

    turns: int = 0  # turns committed
    extended: int = 0  # prompts built by extending an earlier turn's exact tokens
    first: int = 0  # the session's first render
    fresh: int = 0  # renders from scratch although the session had turns: history was rewritten
    # why, per fresh render (most recent last, bounded)
    fresh_reasons: list[str] = field(default_factory=list)
    streams: int = 0  # distinct token streams (first + fresh)

    def to_dict(self) -> dict[str, Any]:
        return {
            "turns": self.turns,
            "extended": self.extended,
            "first": self.first,
            "fresh": self.fresh,
            "fresh_reasons": list(self.fresh_reasons),
            "streams": self.streams,
        }


@dataclass
class _Turn:
    n: int  # messages in its conversation (prompt + the answer)
    chain: int  # hash chain over those messages' keys
    keys: tuple[Hashable, ...]
    tools_key: Hashable
    # template dicts of the prompt messages (the answer is appended at bridge time)
    history: list[dict[str, Any]]
    prompt_ids: np.ndarray[Any, np.dtype[np.int32]]
    output_ids: np.ndarray[Any, np.dtype[np.int32]]
    prompt_text: str | None
    stream: int


@dataclass
class Prepared:
    """A prompt ready for the engine, and what :meth:`TokenStreams.commit` needs to record its answer."""

    session_id: str
    prompt_ids: list[int]
    mode: Mode
    reason: str | None
    stream: int
    template_messages: list[dict[str, Any]]
    template_tools: list[dict[str, Any]] | None
    prompt_text: str | None
    base_prompt_tokens: int  # tokens taken verbatim from the base turn (0 for a render)
    _keys: tuple[Hashable, ...]
    _chains: list[int]
    _tools_key: Hashable


def _tools_key(tools: Sequence[Tool]) -> Hashable:
    return tuple((t.type, t.name, t.description, repr(t.parameters)) for t in tools)


class _Session:
    __slots__ = ("by_chain", "lock", "next_stream", "order", "requests", "stats")

    def __init__(self) -> None:
        self.by_chain: dict[tuple[int, int], _Turn] = {}
        self.order: list[tuple[int, int]] = []  # insertion order, for eviction
        self.stats = StreamStats()
        self.next_stream = 0
        self.requests = 0  # requests prepared so far
        self.lock = threading.Lock()


class TokenStreams:
    """The token streams of many sessions, over one :class:`ChatRenderer`.

    Args:
        renderer: the model's renderer.
        max_turns_kept: per session, how many recent turns stay matchable (older ones are
            forgotten: a request continuing one of them is rendered fresh). Bounds memory: a turn
            keeps its prompt + output ids (4 bytes a token).
        max_sessions: sessions kept; the least recently used is dropped beyond it.
        max_reasons: fresh-render reasons kept per session.
    """

    def __init__(
        self, renderer: ChatRenderer, *, max_turns_kept: int = 32, max_sessions: int = 4096,
        max_reasons: int = 32
    ) -> None:
        if max_turns_kept < 1 or max_sessions < 1:
            raise ValueError("max_turns_kept and max_sessions must be at least 1")
        self.renderer = renderer
        self.max_turns_kept = max_turns_kept
        self.max_sessions = max_sessions
        self.max_reasons = max_reasons
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._lock = threading.Lock()

    def _session(self, session_id: str) -> _Session:
        with self._lock:
            s = self._sessions.get(session_id)
            if s is None:
                s = self._sessions[session_id] = _Session()
                while len(self._sessions) > self.max_sessions:
                    self._sessions.popitem(last=False)
            else:
                self._sessions.move_to_end(session_id)
            return s

    def stats(self, session_id: str) -> StreamStats:
        """The session's counters (a fresh, zero :class:`StreamStats` for an unknown session)."""
        with self._lock:
            s = self._sessions.get(session_id)
        return s.stats if s is not None else StreamStats()

    def request_number(self, session_id: str) -> int:
        """How many requests of the session were prepared before the latest one (0 for the first)."""
        s = self._session(session_id)
        with s.lock:
            return max(0, s.requests - 1)

    def drop(self, session_id: str) -> StreamStats | None:
        """Forget a session; returns its final counters."""
        with self._lock:
            s = self._sessions.pop(session_id, None)
        return None if s is None else s.stats

    # ------------------------------------------------------------------ core
    def prepare(self, session_id: str, messages: Sequence[Message], tools: Sequence[Tool] = ()) -> Prepared:
        """The prompt ids for a request of ``session_id`` (extension of an earlier turn when possible).

        Raises :class:`~ares_gateway.tokens.renderer.RenderError` for content the renderer cannot take.
        """
        r = self.renderer
        s = self._session(session_id)
        tmsgs = r.template_messages(messages)
        ttools = r.template_tools(tools)
        tkey = _tools_key(tools)
        keys = tuple(message_key(m.to_chat_dict()) for m in messages)
        chains = [0] * (len(keys) + 1)
        h = 0
        for i, k in enumerate(keys):
            h = hash((h, k))
            chains[i + 1] = h
        with s.lock:
            s.requests += 1
            base = self._deepest(s, keys, chains, tkey)
            had_turns = bool(s.by_chain)
        reason: str | None = None
        if base is not None:
            history = [*base.history, tmsgs[base.n - 1]]
            b = r.bridge(
                base.prompt_ids.tolist(), base.output_ids.tolist(), history, tmsgs[base.n :], ttools,
                prev_prompt_text=base.prompt_text,
            )
            if b.prompt_ids is not None:
                with s.lock:
                    s.stats.extended += 1
                return Prepared(
                    session_id, b.prompt_ids, "extend", None, base.stream, tmsgs, ttools, b.text,
                    int(base.prompt_ids.shape[0] + base.output_ids.shape[0]), keys, chains, tkey,
                )
            reason = b.reason
        elif had_turns:
            reason = "the request continues no recorded turn (history rewritten, compacted, or a side call)"
        rendered = r.render(tmsgs, ttools)
        with s.lock:
            stream = s.next_stream
            s.next_stream += 1
            s.stats.streams += 1
            if had_turns or base is not None:
                mode: Mode = "fresh"
                s.stats.fresh += 1
                s.stats.fresh_reasons.append(reason or "")
                del s.stats.fresh_reasons[: -self.max_reasons]
            else:
                mode = "first"
                s.stats.first += 1
        return Prepared(
            session_id, rendered.prompt_ids, mode, reason, stream, tmsgs, ttools, rendered.text, 0, keys,
            chains, tkey
        )

    def commit(self, prepared: Prepared, output_ids: Sequence[int], answer: Message) -> None:
        """Record the answer to ``prepared`` so that later requests continuing it extend its tokens.

        ``answer`` is the assistant message the agent was given (its key is what the echo must match).
        An empty generation is not recorded (nothing to extend).
        """
        s = self._session(prepared.session_id)
        with s.lock:
            s.stats.turns += 1
            if not output_ids:
                return
            akey = message_key(answer.to_chat_dict())
            n = len(prepared._keys) + 1
            chain = hash((prepared._chains[-1], akey))
            turn = _Turn(
                n=n,
                chain=chain,
                keys=(*prepared._keys, akey),
                tools_key=prepared._tools_key,
                history=prepared.template_messages,
                prompt_ids=np.asarray(prepared.prompt_ids, dtype=np.int32),
                output_ids=np.asarray(output_ids, dtype=np.int32),
                prompt_text=prepared.prompt_text,
                stream=prepared.stream,
            )
            key = (n, chain)
            if key in s.by_chain:
                s.order.remove(key)
            s.by_chain[key] = turn
            s.order.append(key)
            while len(s.order) > self.max_turns_kept:
                s.by_chain.pop(s.order.pop(0), None)

    @staticmethod
    def _deepest(s: _Session, keys: tuple[Hashable, ...], chains: list[int], tkey: Hashable) -> _Turn | None:
        # Deepest first: the longest recorded conversation the request continues. The last message
        # must be new (n < len(keys)), else there is nothing to extend with.
        for n in range(len(keys) - 1, 0, -1):
            t = s.by_chain.get((n, chains[n]))
            if t is not None and t.tools_key == tkey and t.keys == keys[:n]:
                return t
        return None
