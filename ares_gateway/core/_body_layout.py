"""Where a request body's growing list and its items lie in the body's raw bytes.

An agent re-sends its whole history every turn, as JSON it wrote the same way each time. With where
the previous turn's list items lay in its raw body and a digest of its bytes up to each item's end,
the items a new body shares with it are found by hashing the new body's bytes at the same offsets
(BLAKE3, at about 6 GB/s here; SHA-256 from the standard library hashes at a fifth of that): only
the bytes after the last shared item are read, with the standard library's JSON scanner (which
reports where each value ends; orjson, which parsed the body, does not). So the cost of finding the
shared history does not grow with it beyond hashing it, and a session keeps digests (16 bytes an
item) where it would keep the previous body's list (half a megabyte at a Claude Code session's 200th
turn).

Only the layout of a body whose top-level object was walked (:func:`layout_of`), or one derived
from such a layout with every byte outside the list either shared or walked again, is trusted: a
body with the list's key twice (orjson keeps the last) never gets one.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_right
from collections.abc import Callable
from json.scanner import make_scanner
from typing import Any, NamedTuple

from blake3 import blake3

_WS = re.compile(r"[ \t\n\r]*")
# The C scanner behind json.loads: (value, end offset) of the JSON value at an offset.
# (typeshed types make_scanner as a class taking itself.)
_scan: Callable[[str, int], tuple[Any, int]] = make_scanner(json.JSONDecoder())  # type: ignore[arg-type]
_DIGITS = frozenset(b"0123456789")
_NUMBER = frozenset(b"0123456789.eE+-")
#: Bytes of BLAKE3 kept per digest: 128 bits, as the turn record's own digests. A collision would
#: take another body's item for this one's (its decoding spliced into the body), so a fast
#: non-cryptographic checksum, which an agent could collide on purpose, will not do.
_MARK = 16
#: The items before the last ``_PROBE`` are checked with one digest first (:func:`shared_items`).
_PROBE = 3


class BodyLayout:
    """Where one body's list lies in its raw bytes (byte offsets), and digests of those bytes.

    The list's bytes are not kept, only a digest of the bytes from the ``[`` to each item's end
    (``marks``, :data:`_MARK` bytes each, in one ``bytes``); with the bytes before the list
    (``head``) and from its ``]`` on (``tail``: a Claude Code body's system prompt and tools, the
    same object from turn to turn while they do not change), they are all that a next body is
    compared against.
    """

    __slots__ = ("close", "ends", "head", "marks", "start", "tail")

    def __init__(self, head: bytes, ends: list[int], close: int, tail: bytes, marks: bytes) -> None:
        self.head = head
        #: Just after the list's ``[``.
        self.start = len(head)
        #: Just after each item.
        self.ends = ends
        #: At the list's ``]``.
        self.close = close
        self.marks = marks
        self.tail = tail


class LayoutHint(NamedTuple):
    """What the parse of a body found of its layout, handed on to the recorder so that it need not
    compare the bodies again: the layout of ``raw``, and (``continued``) what :func:`continue_layout`
    gave against the layout ``prev`` (``None``: not compared)."""

    layout: BodyLayout
    raw: bytes
    prev: BodyLayout | None = None
    continued: tuple[int, BodyLayout, bool] | None = None


class Shared(NamedTuple):
    """What :func:`shared_items` found: how many leading items are shared, and the running hash of the
    new body's bytes from the list's ``[`` to the last of them (to go on with)."""

    kept: int
    hasher: blake3


def _mark(hasher: blake3) -> bytes:
    return hasher.digest(_MARK)


def _marks(raw: bytes, pos: int, ends: list[int], hasher: blake3) -> bytes:
    """The digests for items ending at ``ends`` in ``raw``, going on from ``hasher`` (the hash of the
    bytes up to ``pos``); ``hasher`` is advanced past the last of them."""
    mv = memoryview(raw)
    out = []
    for e in ends:
        hasher.update(mv[pos:e])
        out.append(_mark(hasher))  # BLAKE3's digest leaves the hasher as it was, to go on
        pos = e
    return b"".join(out)


def _ws(text: str, i: int) -> int:
    m = _WS.match(text, i)
    assert m is not None  # the pattern matches the empty string
    return m.end()


def _items(text: str, i: int, after_item: bool) -> tuple[list[int], int]:
    """From ``i`` inside a JSON list (just after ``[``, or just after an item when ``after_item``):
    the offset just after each further item, and the offset of the list's ``]``."""
    ends: list[int] = []
    while True:
        i = _ws(text, i)
        c = text[i : i + 1]
        if c == "]":
            return ends, i
        if after_item or ends:
            if c != ",":
                raise ValueError("not a JSON list")
            i = _ws(text, i + 1)
        _, i = _scan(text, i)
        ends.append(i)


def _members(text: str, i: int, key: str, *, after_member: bool) -> tuple[int | None, list[int], int, int]:
    """Walk a top-level object's members from ``i`` (just after ``{``, or just after a member's
    value when ``after_member``) to its end. Returns the list under ``key`` if met (its start, item
    ends and close), and the offset just after the object; raises if ``key`` comes twice."""
    start: int | None = None
    ends: list[int] = []
    close = -1
    first = not after_member
    while True:
        i = _ws(text, i)
        c = text[i : i + 1]
        if c == "}" and first:
            return start, ends, close, i + 1
        if not first:
            if c == "}":
                return start, ends, close, i + 1
            if c != ",":
                raise ValueError("not a JSON object")
            i = _ws(text, i + 1)
        first = False
        name, i = _scan(text, i)
        if not isinstance(name, str):
            raise ValueError("not a JSON object")
        i = _ws(text, i)
        if text[i : i + 1] != ":":
            raise ValueError("not a JSON object")
        i = _ws(text, i + 1)
        if name == key:
            if start is not None or text[i : i + 1] != "[":
                raise ValueError(f"{key!r} is twice in the body, or not a list")
            start = i + 1
            ends, close = _items(text, start, False)
            i = close + 1
        else:
            _, i = _scan(text, i)


def _to_bytes(text: str, base: int, offsets: list[int]) -> list[int]:
    """Character offsets into ``text`` (sorted) as byte offsets into its UTF-8, which starts at ``base``."""
    if text.isascii():
        return [base + o for o in offsets]
    out: list[int] = []
    prev = 0
    for o in offsets:
        base += len(text[prev:o].encode())
        out.append(base)
        prev = o
    return out


def _layout(raw: bytes, head: bytes, ends: list[int], close: int, tail: bytes, marks: bytes = b"",
            hasher: blake3 | None = None) -> BodyLayout:
    """The layout of ``raw``, ``marks`` the marks of its first items and ``hasher`` the hash of their
    bytes (``None``: every mark computed here)."""
    if hasher is None:
        marks, hasher = b"", blake3()
    done = len(marks) // _MARK
    pos = ends[done - 1] if done else len(head)
    return BodyLayout(head, ends, close, tail, marks + _marks(raw, pos, ends[done:], hasher))


def layout_of(raw: bytes, key: str, count: int) -> BodyLayout | None:
    """The layout of ``raw``, a JSON object whose list under ``key`` has ``count`` items (``None``
    when it is not such a body: ``key`` twice or absent, or a count that does not agree)."""
    try:
        text = raw.decode()
        i = _ws(text, 0)
        if text[i : i + 1] != "{":
            return None
        start, ends, close, end = _members(text, i + 1, key, after_member=False)
    except (ValueError, StopIteration, RecursionError, UnicodeDecodeError):
        return None
    if start is None or len(ends) != count or _ws(text, end) != len(text):
        return None
    offs = _to_bytes(text, 0, [start, *ends, close])
    return _layout(raw, raw[: offs[0]], offs[1:-1], offs[-1], raw[offs[-1] :])


def shared_items(prev: BodyLayout, raw: bytes) -> Shared | None:
    """How many leading items of ``prev``'s list ``raw`` repeats: the same bytes at the same offsets,
    and every byte before the list as well. ``None``: ``raw`` differs before the list.

    A mark covers every byte from the list's ``[`` to its item's end, so the items shared are those
    up to the last item whose mark ``raw`` gives. Agents append to their history, so most often every
    item is sent again, or all but the last one or two (Claude Code moves its cache mark off the last
    message each turn): the first item is checked, then the bytes up to :data:`_PROBE` items before
    the last that ``raw`` can hold, in one call, then the items after one by one. When that probe
    fails (a history edited or cut short), the last shared item is found by halving.
    """
    if not raw.startswith(prev.head):
        return None
    ends, marks = prev.ends, prev.marks
    mv = memoryview(raw)
    hasher = blake3()
    kept, pos = 0, prev.start
    hi = bisect_right(ends, len(raw))  # the items past these do not end within raw: not shared
    probing = True
    while kept < hi:
        if kept and probing:
            at = max(kept, hi - 1 - _PROBE)
        elif kept:
            at = (kept + hi - 1) // 2
        else:
            at = 0
        step = hasher.copy()
        step.update(mv[pos : ends[at]])
        if _mark(step) == marks[_MARK * at : _MARK * (at + 1)]:
            hasher, kept, pos = step, at + 1, ends[at]
        else:
            probing, hi = False, at
    return Shared(kept, hasher)


def continue_layout(prev: BodyLayout, raw: bytes, key: str, count: int | None,
                    shared: Shared | None = None) -> tuple[int, BodyLayout, bool] | None:
    """How many leading items the list in ``raw`` (``count`` of them; ``None``: not known, as before
    ``raw`` is decoded) shares with ``prev``'s, the layout of ``raw``, and whether every byte after
    the list is as in ``prev``. ``None``: the bodies differ before the list (or ``raw`` is not such a
    body); walk it with :func:`layout_of`. ``shared``: :func:`shared_items` of the two, if known."""
    if shared is None:
        shared = shared_items(prev, raw)
        if shared is None:
            return None
    kept = shared.kept
    hasher: blake3 | None = shared.hasher.copy()  # advanced below; the caller's stays as it was
    # The items whose bytes are all shared are the same JSON values; but a number only if it ends
    # there in the new body too ("12" may go on as "123").
    end = prev.ends[kept - 1] if kept else 0
    if kept and raw[end - 1] in _DIGITS and raw[end : end + 1] and raw[end] in _NUMBER:
        kept, hasher = kept - 1, None  # the marks computed again from the first item
    pos = prev.ends[kept - 1] if kept else prev.start
    fast = _continue_to_same_tail(prev, raw, pos, kept, count, hasher)
    if fast is not None:
        return fast
    try:
        text = raw[pos:].decode()
        ends, close = _items(text, 0, kept > 0)
        if count is not None and kept + len(ends) != count:
            return None
        offs = _to_bytes(text, pos, [*ends, close])
        close_at = offs[-1]
        tail = raw[close_at:]
        same_after = tail == prev.tail
        if same_after:
            tail = prev.tail
        if not same_after and (b'"%s"' % key.encode() in tail or b"\\u" in tail):
            # The fields after the list changed and may name the list's key (as written or escaped):
            # walk them, so a second list cannot hide there.
            again, _, _, end = _members(text, close + 1, key, after_member=True)
            if again is not None or _ws(text, end) != len(text):
                return None
    except (ValueError, StopIteration, RecursionError, UnicodeDecodeError):
        return None
    layout = _layout(raw, prev.head, prev.ends[:kept] + offs[:-1], close_at, tail, prev.marks[: _MARK * kept],
                     hasher)
    return kept, layout, same_after


def _continue_to_same_tail(prev: BodyLayout, raw: bytes, pos: int, kept: int, count: int | None,
                           hasher: blake3 | None) -> tuple[int, BodyLayout, bool] | None:
    """:func:`continue_layout` when ``raw`` ends with every byte ``prev`` had from its list's ``]``
    on (the fields after the list unchanged, as an agent's next turn sends them): only the bytes
    between the last shared item and that ``]`` are decoded and walked, where the whole rest of the
    body (a Claude Code body's system prompt and tools, after its messages) would be. ``None``: it
    does not, or the list does not close exactly there; then the whole rest is walked.

    The walk from ``pos`` (just after a shared item, or the ``[``) reads what the whole body's walk
    would read up to that ``]``: every value there ends before it, and a number cannot run on into
    it. From the ``]`` on the bytes are ``prev``'s, after its list: the same members, already walked.
    """
    close_at = len(raw) - len(prev.tail)
    if close_at < pos or not raw.endswith(prev.tail):
        return None
    try:
        text = raw[pos : close_at + 1].decode()
        ends, close = _items(text, 0, kept > 0)
    except (ValueError, StopIteration, RecursionError, UnicodeDecodeError):
        return None
    if close != len(text) - 1 or (count is not None and kept + len(ends) != count):
        return None
    offs = _to_bytes(text, pos, [*ends, close])
    layout = _layout(raw, prev.head, prev.ends[:kept] + offs[:-1], offs[-1], prev.tail,
                     prev.marks[: _MARK * kept], hasher)
    return kept, layout, True
