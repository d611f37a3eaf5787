"""Where a request body's growing list and its items lie in the body's raw bytes.

An agent re-sends its whole history every turn, as JSON it wrote the same way each time. With the
previous turn's raw body and the byte offsets of its list's items, the items a new body shares with
it are found by comparing the two bodies' bytes (at memory speed): the shared leading bytes cover
whole items, and only the bytes after the last shared item are read, with the standard library's
JSON scanner (which reports where each value ends; orjson, which parsed the body, does not). So the
cost of finding the shared history does not grow with it.

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

_WS = re.compile(r"[ \t\n\r]*")
# The C scanner behind json.loads: (value, end offset) of the JSON value at an offset.
# (typeshed types make_scanner as a class taking itself.)
_scan: Callable[[str, int], tuple[Any, int]] = make_scanner(json.JSONDecoder())  # type: ignore[arg-type]
_DIGITS = frozenset(b"0123456789")
_NUMBER = frozenset(b"0123456789.eE+-")
#: The run of bytes :func:`common_prefix` compares at a time once the whole differs.
_RUN = 8192


class BodyLayout:
    """One body's raw bytes and where its list lies in them (byte offsets)."""

    __slots__ = ("close", "ends", "raw", "start")

    def __init__(self, raw: bytes, start: int, ends: list[int], close: int) -> None:
        self.raw = raw
        #: Just after the list's ``[``.
        self.start = start
        #: Just after each item.
        self.ends = ends
        #: At the list's ``]``.
        self.close = close


class LayoutHint(NamedTuple):
    """What the parse of a body found of its layout, handed on to the recorder so that it need not
    compare the bodies again: the layout of ``layout.raw``, and (``continued``) what
    :func:`continue_layout` gave against the body ``prev`` (``None``: not compared)."""

    layout: BodyLayout
    prev: bytes | None = None
    continued: tuple[int, BodyLayout, bool] | None = None


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
    return BodyLayout(raw, offs[0], offs[1:-1], offs[-1])


def common_prefix(a: bytes, b: bytes) -> int:
    """How many leading bytes ``a`` and ``b`` share, by ``memcmp`` (``bytes.startswith`` of a
    ``memoryview``: no copy): the whole first, then runs of ``_RUN`` bytes, then halves of the run
    that differs."""
    n = min(len(a), len(b))
    mb = memoryview(b)
    if a.startswith(mb[:n]):
        return n
    lo = 0
    while lo + _RUN <= n and a.startswith(mb[lo : lo + _RUN], lo):
        lo += _RUN
    hi = min(n, lo + _RUN)  # they differ in [lo, hi)
    while hi - lo > 64:
        mid = (lo + hi) // 2
        if a.startswith(mb[lo:mid], lo):
            lo = mid
        else:
            hi = mid
    while lo < hi and a[lo] == b[lo]:
        lo += 1
    return lo


def continue_layout(prev: BodyLayout, raw: bytes, key: str, count: int | None,
                    shared: int | None = None) -> tuple[int, BodyLayout, bool] | None:
    """How many leading items the list in ``raw`` (``count`` of them; ``None``: not known, as before
    ``raw`` is decoded) shares with ``prev``'s, the layout of ``raw``, and whether every byte after
    the list is as in ``prev``. ``None``: the bodies differ before the list (or ``raw`` is not such a
    body); walk it with :func:`layout_of`. ``shared``: :func:`common_prefix` of the two, if known."""
    old = prev.raw
    if shared is None:
        shared = common_prefix(raw, old)
    if shared < prev.start:
        return None
    # The items whose bytes are all shared are the same JSON values; but a number only if it ends
    # there in the new body too ("12" may go on as "123").
    kept = bisect_right(prev.ends, shared)
    if kept and prev.ends[kept - 1] == shared and old[shared - 1] in _DIGITS and raw[shared:shared + 1] \
            and raw[shared] in _NUMBER:
        kept -= 1
    pos = prev.ends[kept - 1] if kept else prev.start
    fast = _continue_to_same_tail(prev, raw, pos, kept, count)
    if fast is not None:
        return fast
    try:
        text = raw[pos:].decode()
        ends, close = _items(text, 0, kept > 0)
        if count is not None and kept + len(ends) != count:
            return None
        offs = _to_bytes(text, pos, [*ends, close])
        close_at = offs[-1]
        same_after = raw[close_at:] == old[prev.close :]
        if not same_after and (b'"%s"' % key.encode() in raw[close_at:] or b"\\u" in raw[close_at:]):
            # The fields after the list changed and may name the list's key (as written or escaped):
            # walk them, so a second list cannot hide there.
            again, _, _, end = _members(text, close + 1, key, after_member=True)
            if again is not None or _ws(text, end) != len(text):
                return None
    except (ValueError, StopIteration, RecursionError, UnicodeDecodeError):
        return None
    return kept, BodyLayout(raw, prev.start, prev.ends[:kept] + offs[:-1], close_at), same_after


def _continue_to_same_tail(prev: BodyLayout, raw: bytes, pos: int, kept: int,
                           count: int | None) -> tuple[int, BodyLayout, bool] | None:
    """:func:`continue_layout` when ``raw`` ends with every byte ``prev`` had from its list's ``]``
    on (the fields after the list unchanged, as an agent's next turn sends them): only the bytes
    between the last shared item and that ``]`` are decoded and walked, where the whole rest of the
    body (a Claude Code body's system prompt and tools, after its messages) would be. ``None``: it
    does not, or the list does not close exactly there; then the whole rest is walked.

    The walk from ``pos`` (just after a shared item, or the ``[``) reads what the whole body's walk
    would read up to that ``]``: every value there ends before it, and a number cannot run on into
    it. From the ``]`` on the bytes are ``prev``'s, after its list: the same members, already walked.
    """
    old = prev.raw
    tail = len(old) - prev.close
    close_at = len(raw) - tail
    if close_at < pos or not raw.endswith(memoryview(old)[prev.close :]):
        return None
    try:
        text = raw[pos : close_at + 1].decode()
        ends, close = _items(text, 0, kept > 0)
    except (ValueError, StopIteration, RecursionError, UnicodeDecodeError):
        return None
    if close != len(text) - 1 or (count is not None and kept + len(ends) != count):
        return None
    offs = _to_bytes(text, pos, [*ends, close])
    return kept, BodyLayout(raw, prev.start, prev.ends[:kept] + offs[:-1], offs[-1]), True
