"""Agents' request bodies parsed into their canonical form: small ones on the event loop, large ones off it.

A 30 MB, 60,000-message body costs about 0.12 s of ``orjson.loads``, 0.45 s of the protocol's
canonical conversion and 0.05 s of encoding the canonical form for ``/poll``; on the event loop
that stalls every other session for that long. A thread alone does not
help: orjson and the encoder hold the GIL for their whole call (a 30 MB ``loads`` is one 0.1 s
hold). So a body of ``offload_bytes`` or more goes this way:

1. a **worker process** decodes it with orjson, converts it with the protocol's adapter (so every
   error, JSON or protocol, is found there, with the same message as on the loop) and encodes
   the canonical form for ``/poll``; it sends back the decoded body cut into pickled pieces of
   about ``piece_bytes`` each (a long list by runs of items, a large object by runs of members,
   recursively);
2. a **thread** of this process rebuilds the body from the pieces and converts it again (the
   objects must live in this process): each piece is one short C call, the conversion is Python
   code, so the GIL passes back to the event loop every few milliseconds.

The result is the same as :func:`parse_inline`'s: the same body, request and errors. If the
worker process fails (killed, say), the body is parsed in the thread as a whole instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import pickle
from concurrent.futures.process import BrokenProcessPool
from typing import Any, NamedTuple

import orjson

from ares_gateway.core._body_layout import (
    BodyLayout,
    LayoutHint,
    Shared,
    continue_layout,
    layout_of,
    shared_items,
)
from ares_gateway.core.broker import UNENCODABLE_REQUEST, CanonicalEncoder, _canonical_json
from ares_gateway.core.canonical import CanonicalRequest, Message, Tool, WireProtocol
from ares_gateway.core.record_codec import LIST_KEYS
from ares_gateway.core.wire import Reuse, nests_deeper
from ares_gateway.protocols import RequestError, get_adapter

log = logging.getLogger(__name__)

#: What a plan's piece is: a pickled value (a whole value, a run of list items, or of object members).
_Piece = bytes
#: ``("L", parts)``: a list, each part a piece (items to extend with) or a nested plan (one item);
#: ``("D", parts)``: an object, each part a piece (members to add) or ``(key, plan)``.
_Plan = Any


class ParsedBody(NamedTuple):
    """A body as parsed JSON, its canonical request, and (when parsed off the loop) the canonical
    form already encoded for ``/poll``, or (through a session's :class:`ParseMemo`) the encoder of
    the request's line."""

    body: Any
    request: CanonicalRequest | None
    canonical_json: bytes | None
    encoder: CanonicalEncoder | None = None
    layout: LayoutHint | None = None


def _json_error(exc: Exception) -> RequestError:
    return RequestError(f"request body is not valid JSON: {exc}")


def _check_depth(value: Any, depth: int = 1) -> None:
    """A body (or, at ``depth``, the part of one not seen before) nested past what the gateway can
    record and hand on is the agent's 400 here, before it is parked: answered, its turn would be
    recorded as lost, whatever the policy polled it with."""
    if nests_deeper(value, depth=depth):
        raise RequestError(UNENCODABLE_REQUEST)


class _Line:
    __slots__ = ("body", "encoder", "ends", "items", "layout", "messages", "protocol", "tools")

    def __init__(self, protocol: WireProtocol, layout: BodyLayout) -> None:
        self.protocol = protocol
        self.encoder = CanonicalEncoder()
        self.layout = layout
        self.body: dict[str, Any] = {}
        self.items: list[Any] = []
        self.messages: list[Message] = []
        self.tools: list[Tool] = []
        self.ends: list[int] = []


_WS = b" \t\r\n"


class ParseMemo:
    """One session's latest bodies, so that its next request decodes and converts only what is new.

    An agent re-sends its whole history every turn, as the same bytes. With where the previous body's
    list items lay in its raw bytes and digests of those bytes (:mod:`ares_gateway.core._body_layout`),
    the items a new body shares with it are found by hashing the new body's bytes at the same places,
    never by comparing parsed values (``1 == True`` in Python). When nothing outside the list changed,
    only the bytes of the new items are decoded, and the new body is the previous one with those items
    added (the same objects: neither is ever mutated); the messages of the shared items and the tools
    are taken over as well (:class:`~ares_gateway.core.wire.Reuse`). A long session's turn then costs
    what its new messages cost, where decoding, converting and freeing the whole body cost what the
    history costs.
    Two lines are kept, the most recently used first, because an agent's side calls (titles,
    summaries: other bodies) come between its main turns.

    Each line also has a :class:`~ares_gateway.core.broker.CanonicalEncoder`, which encodes its
    requests' canonical form for ``/poll`` reusing what the last one shared (the same objects).

    Kept per session (``Session.parse_memo``), for each line: the previous body's layout (the same
    object the recorder keeps for its own delta), its decoded list and top-level object, its
    canonical messages and tools, and their encoding once polled. Bodies the gateway parses off the
    loop never come here.
    """

    __slots__ = ("lines",)

    def __init__(self) -> None:
        self.lines: list[_Line] = []

    def _best(self, protocol: WireProtocol, raw: bytes) -> tuple[_Line | None, Shared | None]:
        best: _Line | None = None
        most: Shared | None = None
        for line in self.lines:
            if line.protocol is not protocol:
                continue
            shared = shared_items(line.layout, raw)
            # A body that does not share its first item's bytes is another line's (or a new one).
            if shared is not None and (shared.kept or not line.layout.ends) \
                    and (most is None or shared.kept > most.kept):
                best, most = line, shared
        return best, most

    def parse(self, protocol: WireProtocol, raw: bytes) -> ParsedBody:
        """``raw`` decoded and converted in ``protocol``, taking over what it shares with this
        session's previous request on its line; then remembered for the next one. Raises
        :class:`RequestError`, as :func:`parse_inline` does."""
        adapter = get_adapter(protocol)
        key = LIST_KEYS[protocol]
        line, shared = self._best(protocol, raw)
        got = None if line is None or shared is None else continue_layout(line.layout, raw, key, None, shared)
        body: Any = None
        if line is not None and got is not None and got[2]:
            body = self._grown(line, raw, key, got[0], got[1])
        if body is None:
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                raise _json_error(exc) from None
            _check_depth(body)
        items = body.get(key) if isinstance(body, dict) else None
        if not isinstance(items, list):
            return ParsedBody(body, adapter.parse_request(body), None)
        reuse = None
        layout: BodyLayout | None
        if line is not None and got is not None and len(got[1].ends) == len(items):
            kept, layout, outside = got
            reuse = Reuse(kept, outside, line.messages, line.tools, line.ends)
        else:
            layout = layout_of(raw, key, len(items))  # once per line: the whole body walked
        ends: list[int] = []
        request = adapter.parse_request(body, reuse=reuse, ends=ends)
        if layout is None:  # not a body the layout can follow (its list's key twice, say)
            return ParsedBody(body, request, None)
        hint = LayoutHint(layout, raw)
        if reuse is None or line is None:
            line = _Line(protocol, layout)
            if len(self.lines) >= 2:
                self.lines.pop()
        else:
            assert got is not None
            hint = LayoutHint(layout, raw, line.layout, got)
            self.lines.remove(line)
        line.layout, line.body, line.items = layout, body, items
        line.messages, line.tools, line.ends = request.messages, request.tools, ends
        self.lines.insert(0, line)
        return ParsedBody(body, request, None, line.encoder, hint)

    @staticmethod
    def _grown(line: _Line, raw: bytes, key: str, kept: int, layout: BodyLayout) -> dict[str, Any] | None:
        """The new body from the previous one and the new items' bytes alone (``None``: decode it whole).

        Every byte outside the list is the previous body's and the first ``kept`` items are its
        items' bytes, so the body is that one with ``kept`` items and then the new ones, decoded by
        orjson (a region it refuses, such as a NaN the scanner let through, is decoded whole instead,
        for orjson's own error)."""
        prev = line.layout
        pos = prev.ends[kept - 1] if kept else prev.start
        region = raw[pos : layout.close].lstrip(_WS)
        if kept and region[:1] == b",":
            region = region[1:]
        try:
            new = orjson.loads(b"[" + region + b"]")
        except orjson.JSONDecodeError:
            return None
        if kept + len(new) != len(layout.ends):
            return None
        _check_depth(new, depth=2)  # the list's level in the body; the rest was checked when it came
        # Items the previous body had at the same places but in other bytes (Claude Code moves its
        # cache mark off the last message each turn) keep the previous decoding's strings: the message
        # tree already holds those, and a long tool result would otherwise be held twice.
        for i in range(min(len(new), len(line.items) - kept)):
            new[i] = _with_strings_of(new[i], line.items[kept + i])
        body = dict(line.body)
        body[key] = line.items[:kept] + new
        return body


def _with_strings_of(new: Any, old: Any, depth: int = 0) -> Any:
    """``new`` (freshly decoded, so ours to change) with each string equal to the one at the same
    place in ``old`` replaced by ``old``'s object. Only strings are taken over: values are never
    compared as values (``1 == True``), and the structure stays ``new``'s."""
    if type(new) is str:
        return old if type(old) is str and old == new else new
    if depth < 8:
        if type(new) is dict and type(old) is dict:
            for k, v in new.items():
                if k in old:
                    new[k] = _with_strings_of(v, old[k], depth + 1)
        elif type(new) is list and type(old) is list:
            for i in range(min(len(new), len(old))):
                new[i] = _with_strings_of(new[i], old[i], depth + 1)
    return new


def parse_inline(raw: bytes, protocol: WireProtocol | None, memo: ParseMemo | None = None) -> ParsedBody:
    """Decode ``raw`` and (with a ``protocol``) convert it, here and now (with a ``memo``, taking over
    what the session's previous request shares with it). Raises :class:`RequestError`."""
    if memo is not None and protocol is not None:
        return memo.parse(protocol, raw)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _json_error(exc) from None
    _check_depth(body)  # a body not parked (count_tokens) is still read and encoded again
    if protocol is None:
        return ParsedBody(body, None, None)
    return ParsedBody(body, get_adapter(protocol).parse_request(body), None)


# ---------------------------------------------------------------------------------- the worker process


def _weigh_and_plan(value: Any, piece: int) -> tuple[int, _Plan | None]:
    """The value's approximate size in bytes, and a plan for it if it is bigger than ``piece``
    (``None``: small enough to go whole in its parent's piece)."""
    if isinstance(value, str):
        return len(value) + 8, None
    if isinstance(value, list):
        sub = [_weigh_and_plan(v, piece) for v in value]
        total = 8 + sum(w for w, _ in sub)
        if total <= piece:
            return total, None
        parts: list[Any] = []
        run: list[Any] = []
        run_w = 0
        for v, (w, plan) in zip(value, sub, strict=True):
            if plan is not None or (run and run_w + w > piece):
                if run:
                    parts.append(pickle.dumps(run, 5))
                    run, run_w = [], 0
            if plan is not None:
                parts.append(plan)
            else:
                run.append(v)
                run_w += w
        if run:
            parts.append(pickle.dumps(run, 5))
        return total, ("L", parts)
    if isinstance(value, dict):
        subd = [(k, v, *_weigh_and_plan(v, piece)) for k, v in value.items()]
        total = 8 + sum(len(k) + w for k, _, w, _ in subd)
        if total <= piece:
            return total, None
        dparts: list[Any] = []
        members: dict[str, Any] = {}
        run_w = 0
        for k, v, w, plan in subd:
            if plan is not None or (members and run_w + w > piece):
                if members:
                    dparts.append(pickle.dumps(members, 5))
                    members, run_w = {}, 0
            if plan is not None:
                dparts.append((k, plan))
            else:
                members[k] = v
                run_w += len(k) + w
        if members:
            dparts.append(pickle.dumps(members, 5))
        return total, ("D", dparts)
    return 16, None


def _worker_init() -> None:
    """In the worker process: die with the gateway (Linux), rather than linger after a SIGKILL."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _work(raw: bytes, protocol: str | None, piece: int) -> tuple[Any, ...]:
    """In the worker process: ``("ok", plan, canonical json)``, ``("error", status, message, param)``,
    or ``("whole",)`` (a body nested too deep to cut: parse it whole)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return ("error", 400, str(_json_error(exc)), None)
    if nests_deeper(body):
        return ("error", 400, UNENCODABLE_REQUEST, None)
    canonical = None
    if protocol is not None:
        try:
            request = get_adapter(protocol).parse_request(body)
        except RequestError as exc:
            return ("error", exc.status, exc.message, exc.param)
        except RecursionError:
            return ("whole",)
        try:
            canonical = _canonical_json(request)
        except (ValueError, TypeError):  # nested past the encoders' depth: what /poll refuses too
            return ("error", 400, UNENCODABLE_REQUEST, None)
    try:
        _, plan = _weigh_and_plan(body, piece)
    except RecursionError:
        return ("whole",)
    return ("ok", plan if plan is not None else pickle.dumps(body, 5), canonical)


# ---------------------------------------------------------------------------------- this process


def _build(plan: _Plan) -> Any:
    if isinstance(plan, bytes):
        return pickle.loads(plan)
    kind, parts = plan
    if kind == "L":
        items: list[Any] = []
        for part in parts:
            if isinstance(part, bytes):
                items.extend(pickle.loads(part))
            else:
                items.append(_build(part))
        return items
    members: dict[str, Any] = {}
    for part in parts:
        if isinstance(part, bytes):
            members.update(pickle.loads(part))
        else:
            members[part[0]] = _build(part[1])
    return members


def _rebuild(plan: _Plan, protocol: WireProtocol | None, canonical: bytes | None) -> ParsedBody:
    body = _build(plan)
    request = get_adapter(protocol).parse_request(body) if protocol is not None else None
    return ParsedBody(body, request, canonical)


class BodyParser:
    """Parses request bodies; those of ``offload_bytes`` or more off the event loop (module docs).

    ``workers`` worker processes (started on the first large body, with ``spawn``) and one thread
    are shared by every connection of a gateway; :meth:`close` stops them.
    """

    def __init__(self, *, offload_bytes: int = 1024 * 1024, piece_bytes: int = 128 * 1024,
                 workers: int = 1) -> None:
        if offload_bytes < 1 or piece_bytes < 1 or workers < 1:
            raise ValueError("offload_bytes, piece_bytes and workers must be at least 1")
        self.offload_bytes = offload_bytes
        self.piece_bytes = piece_bytes
        self.workers = workers
        self._procs: concurrent.futures.ProcessPoolExecutor | None = None
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        #: Bodies parsed off the loop so far.
        self.offloaded = 0

    async def parse(self, raw: bytes, protocol: WireProtocol | None,
                    memo: ParseMemo | None = None) -> ParsedBody:
        """``raw`` decoded, and converted in ``protocol`` (``None``: decoded only), with ``memo`` (the
        session's :class:`ParseMemo`) when it is parsed on the loop.
        Raises :class:`~ares_gateway.protocols.RequestError` (the agent's 400)."""
        if len(raw) < self.offload_bytes:
            return parse_inline(raw, protocol, memo)
        self.offloaded += 1
        loop = asyncio.get_running_loop()
        thread = self._threads()
        try:
            got = await loop.run_in_executor(self._processes(), _work, raw,
                                             None if protocol is None else protocol.value, self.piece_bytes)
        except (BrokenProcessPool, OSError, pickle.PickleError) as exc:
            log.warning("the body parser's worker process failed (%s); parsing a %d-byte body in a thread",
                        exc, len(raw))
            self._drop_processes()
            got = ("whole",)
        if got[0] == "error":
            raise RequestError(got[2], param=got[3], status=got[1])
        if got[0] == "whole":
            return await loop.run_in_executor(thread, parse_inline, raw, protocol)
        return await loop.run_in_executor(thread, _rebuild, got[1], protocol, got[2])

    def _processes(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._procs is None:
            # spawn, not fork: this process has threads (the store's writer, this parser's).
            self._procs = concurrent.futures.ProcessPoolExecutor(
                max_workers=self.workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_worker_init
            )
        return self._procs

    def _threads(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                 thread_name_prefix="ares-body-parser")
        return self._thread

    def _drop_processes(self) -> None:
        procs, self._procs = self._procs, None
        if procs is not None:
            procs.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stop the worker process and thread (a body being parsed is abandoned)."""
        self._drop_processes()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.shutdown(wait=False, cancel_futures=True)


__all__ = ["BodyParser", "ParseMemo", "ParsedBody", "parse_inline"]
