"""The turn record: how one answered turn is encoded for the data dir, and read back (format version 1).

A session's records are numbered by ``seq`` (1, 2, ...) and kept per *line*: its main line, and its
side calls (``side``). Most records are deltas against the previous record of their line; every
``keyframe_every``-th record of a line (and the first) is a keyframe, stored whole, so a damaged
record makes at most the records up to the next keyframe unreadable. The encoder keeps a
:class:`Line` per line; :class:`Decoder` keeps the previous body and token ids per line.

A record (the bytes in the ``turns`` table) is::

    kind (1 byte)  b"R": raw; b"Z": the rest zlib-compressed (records over 1 KiB);
                   b"X": a tombstone (the turn was answered, its record lost: JSON ``{"lost": why}``)
    u32 LE n       the header's length
    header         n bytes of JSON (below)
    blob           token ids and logprobs (``tok`` below), little-endian

The header (JSON object; version 1). Unknown keys are ignored by readers of the same version:

    v            format version (absent: 1, the records written before it was added)
    rid          the request id (``req_…``)
    proto        the wire protocol (``openai.chat``, ``anthropic.messages``, ``openai.responses``)
    side         whether the turn is a side call (its line)
    ts, lat      when the request was parked (Unix seconds), and the seconds to its answer
    body         the native request body, as a delta:
                   keys   the body's top-level keys, in order
                   base   the seq of the line's record this one continues (absent: a keyframe)
                   set    the top-level fields that changed since ``base`` (all of them in a keyframe)
                   lk     the key of the growing list (``messages`` / ``input``), when the body has one
                   keep   how many leading items of that list are ``base``'s
                   new    the list's items after those
    completion   the canonical completion (JSON, ``exclude_none``), without its token record and
                 its ``policy_version`` (which ``pv`` holds)
    pv           the version of the weights that sampled the answer (absent: none known, as in
                 records written before it was added)
    sampling     the request's sampling parameters that are not defaults (when known)
    use          the call's usage and timing, each key only when known (absent: not known, as in
                 records written before it was added; read back as null, never 0):
                   pt     prompt tokens (the token record's, else the policy's ``usage``)
                   ct     completion tokens (likewise)
                   rp     prompt tokens shared with the previous turn's prompt + output ids
                          (token records only)
                   pk     seconds parked before the policy took the request
                   po     seconds from then to the answer's end (a stream's last piece)
                   ft     seconds to a streamed answer's first piece
                   th     seconds from the session's previous answer's end to this request's arrival
    tok          the token record, when the answer had one:
                   base   the seq whose prompt + output ids this prompt continues (null: none)
                   keep   how many leading ids it shares with them
                   ns     prompt ids stored (the rest of the prompt): int32 in the blob
                   no     output ids: int32 in the blob after those
                   lp     whether ``no`` float64 logprobs follow in the blob
                   fr     the finish reason the engine gave (or null)
                   st     whether the message tree stored the turn, so the next is encoded against
                          it (absent: true, as records before it was added)

A change that old readers would misread takes a new ``v``; a reader refuses a version it does not
know (reported as a damaged record, with the version), and keeps reading the versions it knows.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from ares_gateway.core._body_layout import BodyLayout, LayoutHint, continue_layout, layout_of
from ares_gateway.core.canonical import WireProtocol
from ares_gateway.core.recorder import RecordedTurn
from ares_gateway.core.store import LOST_KIND
from trajectory._tokens import common_prefix_len

#: The version of the record this module writes (and the one it reads; see the module docstring).
FORMAT_VERSION = 1
#: What :meth:`Decoder.decode` raises for a record it cannot read (besides :class:`LostRecordError`).
DECODE_ERRORS: tuple[type[Exception], ...] = (ValueError, KeyError, TypeError, zlib.error, struct.error,
                                              orjson.JSONDecodeError)
#: The key of each protocol's growing list in a request body.
LIST_KEYS = {
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


class Line:
    """What the next turn of one line (a session's main line, or its side calls) is encoded against.

    For the body: where the previous turn's list lay in its raw body, with digests of those bytes; the
    digests of its items as values (for a body that cannot be compared as bytes); and digests of its
    other top-level fields. For token ids, only which turn the next one's are encoded against: the
    message tree holds that turn's ids (:meth:`~trajectory.TrajectoryManager.last_ids`), and they are
    compared there.
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
        #: Where the previous turn's list items lay in its raw body (when it came as bytes).
        self.layout: BodyLayout | None = None
        #: How many leading items the last body's list shared with the one before it, every other
        #: field the same (-1: not so).
        self.kept = -1
        #: The chat dicts of the prompt messages handed to the message tree at turn ``chat_seq``.
        self.chat: list[dict[str, Any]] | None = None
        self.chat_seq: int | None = None

    def follow(self, seq: int, d: dict[str, Any]) -> bool:
        """Move on past record ``seq`` (``d``: as :meth:`Decoder.decode` gave it), as the encoder did
        when it wrote it: how a session read back from a data dir goes on recording. Returns whether
        the next turn's token ids are encoded against this one's."""
        h = d["header"]
        body = d["body"]
        lk = h["body"].get("lk")
        self.seq = seq
        self.since_key = 1 if "base" not in h["body"] else self.since_key + 1
        self.top = {k: _digest(v) for k, v in body.items() if k != lk}
        if lk:
            _list_delta(body[lk], self, fresh=True)
        else:
            self.hashes = []
        if d["prompt_ids"] is not None and h["tok"].get("st", True):
            self.tseq = seq
            return True
        return False


def _list_delta(items: list[Any], line: Line, fresh: bool) -> int:
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


def _body_delta(protocol: WireProtocol, body: dict[str, Any], line: Line, seq: int, key: bool = False,
                raw: bytes | None = None, hint: LayoutHint | None = None) -> dict[str, Any]:
    """The body as a delta against the line's previous turn (``raw``: the bytes it was parsed from;
    ``hint``: what the parse found of its layout, taken when it is of these very bytes)."""
    if hint is not None and (raw is None or hint.raw is not raw):
        hint = None
    lk = LIST_KEYS.get(protocol)
    items = body.get(lk) if lk is not None else None
    if not isinstance(items, list):
        lk, items = None, None
    # The shared history from the raw bytes, when the previous turn's layout is at hand (the common
    # case: its cost does not grow with the history); else from the parsed body.
    shared = None
    if lk is not None and items is not None and raw is not None and line.layout is not None:
        if hint is not None and hint.continued is not None and hint.prev is line.layout:
            shared = hint.continued  # the parse compared these bytes with the same previous body
        else:
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
            line.layout = (None if raw is None else hint.layout if hint is not None
                           else layout_of(raw, lk, len(items)))
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


def encode_tokens(tokens: Any, prompt: npt.NDArray[np.int32], output: npt.NDArray[np.int32], line: Line,
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


def encode_head(turn: RecordedTurn, body: dict[str, Any], lines: dict[bool, Line], seq: int,
                keyframe_every: int,
          raw: bytes | None) -> tuple[dict[str, Any], Line, bool]:
    """A turn's record but for its token ids: the header, with the body delta-encoded against the
    previous turn of its line (updated; ``raw``: the bytes ``body`` was parsed from). Every
    ``keyframe_every``-th record of a line (0: only the first) is a keyframe, stored whole, so a
    damaged record makes at most the records up to the next keyframe unreadable."""
    line = lines.setdefault(turn.side_call, Line())
    key = line.seq is None or 0 < keyframe_every <= line.since_key
    line.since_key = 1 if key else line.since_key + 1
    comp = turn.completion.model_dump(mode="json", exclude_none=True, exclude={"tokens", "policy_version"})
    header: dict[str, Any] = {
        "v": FORMAT_VERSION,
        "rid": turn.request_id,
        "proto": turn.protocol.value,
        "side": turn.side_call,
        "ts": turn.timestamp,
        "lat": turn.latency,
        "body": _body_delta(turn.protocol, body, line, seq, key, raw, turn.layout),
        "completion": comp,
    }
    if turn.policy_version is not None:
        header["pv"] = turn.policy_version
    request = turn._request
    if request is not None:
        header["sampling"] = request.sampling.model_dump(mode="json", exclude_none=True,
                                                         exclude_defaults=True)
    return header, line, key


#: The turn log's ``usage`` fields and the record's ``use`` keys that hold them.
USAGE_KEYS = {
    "prompt_tokens": "pt",
    "completion_tokens": "ct",
    "reused_prompt_tokens": "rp",
    "parked_seconds": "pk",
    "policy_seconds": "po",
    "ttft_seconds": "ft",
    "think_seconds": "th",
}


def encode_use(values: dict[str, int | float | None]) -> dict[str, int | float]:
    """The record's ``use`` from turn-log ``usage`` fields (those ``None`` left out; seconds to the µs)."""
    out: dict[str, int | float] = {}
    for name, key in USAGE_KEYS.items():
        v = values.get(name)
        if v is not None:
            out[key] = round(v, 6) if isinstance(v, float) else v
    return out


def decode_use(use: Any) -> dict[str, int | float | None]:
    """The turn log's ``usage`` from a record's ``use`` (every field, ``None`` where not known)."""
    got = use if isinstance(use, dict) else {}
    out: dict[str, int | float | None] = {}
    for name, key in USAGE_KEYS.items():
        v = got.get(key)
        out[name] = v if isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 else None
    return out


def pack(header: dict[str, Any], blob: bytes) -> bytes:
    head = orjson.dumps(header, default=str)
    inner = _HEADER.pack(len(head)) + head + blob
    if len(inner) > _COMPRESS_OVER:
        return b"Z" + zlib.compress(inner, 1)
    return b"R" + inner


class LostRecordError(ValueError):
    """A tombstone: the turn was answered, and its record could not be encoded or stored."""


class Decoder:
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
        version = header.get("v", 1)  # records written before the version key are version 1
        if version != FORMAT_VERSION:
            raise ValueError(
                f"record format version {version!r}: this ares-gateway reads version {FORMAT_VERSION} "
                "(a newer gateway wrote it: read this data dir with that version)")
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


def log_entry(d: dict[str, Any], *, tokens: bool) -> dict[str, Any]:
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
        # null where none is known (never 0): a record without "pv" had none.
        "policy_version": h.get("pv"),
        "usage": decode_use(h.get("use")),
    }
    if "sampling" in h:
        entry["sampling"] = h["sampling"]
    return entry


