"""Sessions: one per agent run, each with its own secret token and base URL."""

from __future__ import annotations

import asyncio
import hmac
import re
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ares_gateway.core.errors import InvalidSessionError, SessionExistsError, UnknownSessionError

#: Longest session id accepted (ids appear in URL paths, container labels and directory names).
MAX_SESSION_ID_CHARS = 128
#: Longest session token accepted (it travels in a header; aiohttp's header lines stop at 8190 bytes).
MAX_TOKEN_CHARS = 512
# ASCII letters, digits, '-' and '_': never '.' or '..', '/', a NUL or a character that looks like
# another (the id names a directory under the runtime dir, see http/session_socket.py).
_ID = re.compile(r"[A-Za-z0-9_-]+")
# A token is what an HTTP client can send as a header value as it is: visible ASCII, no spaces.
_TOKEN = re.compile(r"[!-~]+")


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """What a trainer needs to point an agent at a session."""

    session_id: str
    token: str
    base_url: str

    def to_dict(self) -> dict[str, str]:
        return {"session_id": self.session_id, "token": self.token, "base_url": self.base_url}


@dataclass(eq=False, slots=True)
class Session:
    """Server-side state of one session. The token never leaves except at creation."""

    id: str
    token: str
    created_at: float
    metadata: dict[str, Any] = field(default_factory=dict)
    #: Answered turns, counted where they are recorded (``Gateway``'s turn sink; an error answer is none).
    turns: int = 0
    ended: bool = False
    reward: float | None = None
    truncated: bool = False
    end_info: dict[str, Any] = field(default_factory=dict)
    #: Set when the session ends, so waiters on "next request or end" wake up.
    ended_event: asyncio.Event = field(default_factory=asyncio.Event)
    #: What the HTTP layer keeps of this session's latest request bodies so the next one converts only
    #: what is new (``ares_gateway.http.body_parser.ParseMemo``; opaque here, dropped when the session ends).
    parse_memo: Any = field(default=None, repr=False)

    def end(self, *, reward: float | None = None, truncated: bool = False,
            info: Mapping[str, Any] | None = None) -> None:
        """Mark the episode over, with its reward, and wake whoever waits for the next request or the end;
        the one place a session's end state is set (ended, restored as ended, or deleted)."""
        self.ended = True
        self.parse_memo = None  # no request of an ended session is parsed again
        self.reward = reward
        self.truncated = truncated
        self.end_info = dict(info or {})
        self.ended_event.set()

    def summary(self) -> dict[str, Any]:
        """A JSON-able view without the token."""
        return {
            "session_id": self.id,
            "created_at": self.created_at,
            "turns": self.turns,
            "ended": self.ended,
            "reward": self.reward,
            "truncated": self.truncated,
            "metadata": self.metadata,
        }


class SessionRegistry:
    """All live sessions, indexed by id and by token.

    ``on_create`` is called with every session created (not restored), e.g. to write it to the data dir.
    """

    def __init__(self, *, on_create: Callable[[Session], None] | None = None) -> None:
        self._by_id: dict[str, Session] = {}
        self._by_token: dict[str, Session] = {}
        self._on_create = on_create

    def create(
        self,
        session_id: str | None = None,
        *,
        token: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Session:
        sid = session_id or secrets.token_hex(8)
        if not isinstance(sid, str):
            raise InvalidSessionError("session_id must be a string")
        if sid in self._by_id:
            raise SessionExistsError(f"session {sid!r} already exists")
        check_session_id(sid)
        if token is not None:
            check_token(token)
        tok = token or f"ags-{secrets.token_urlsafe(24)}"
        if tok in self._by_token:
            raise SessionExistsError("that token is already in use by another session")
        session = Session(id=sid, token=tok, created_at=time.time(), metadata=dict(metadata or {}))
        self._by_id[sid] = session
        self._by_token[tok] = session
        if self._on_create is not None:
            self._on_create(session)
        return session

    def restore(
        self, session_id: str, *, token: str, created_at: float, metadata: dict[str, Any], turns: int = 0
    ) -> Session:
        """Bring back a session a data dir remembers (after a restart), with its token and turn count."""
        if session_id in self._by_id or token in self._by_token:
            raise SessionExistsError(f"session {session_id!r} (or its token) already exists")
        session = Session(id=session_id, token=token, created_at=created_at, metadata=dict(metadata),
                          turns=turns)
        self._by_id[session_id] = session
        self._by_token[token] = session
        return session

    def get(self, session_id: str) -> Session:
        try:
            return self._by_id[session_id]
        except KeyError:
            raise UnknownSessionError(f"no session {session_id!r}") from None

    def find(self, session_id: str) -> Session | None:
        return self._by_id.get(session_id)

    def by_token(self, token: str) -> Session | None:
        return self._by_token.get(token)

    @staticmethod
    def token_matches(session: Session, token: str | None) -> bool:
        return token is not None and same_secret(token, session.token)

    def remove(self, session_id: str) -> Session:
        session = self.get(session_id)
        del self._by_id[session_id]
        self._by_token.pop(session.token, None)
        return session

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self._by_id.values()))

    def __len__(self) -> int:
        return len(self._by_id)


def bearer_token(headers: Mapping[str, str]) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, if there is one."""
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return None


def same_secret(given: str, expected: str) -> bool:
    """Whether ``given`` (from a request header) is ``expected``, in constant time.

    Total over every string: aiohttp hands over header bytes that are not UTF-8 as lone surrogates
    (``surrogateescape``), which a plain ``.encode()`` refuses (that would be a 500 and a traceback per
    request). ``surrogatepass`` encodes them too, to bytes no valid string encodes to, so such a
    value is simply wrong.
    """
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"),
                               expected.encode("utf-8", "surrogatepass"))


def valid_session_id(sid: object) -> bool:
    """Whether ``sid`` is a usable session id: 1-128 ASCII letters, digits, ``-`` and ``_``."""
    return isinstance(sid, str) and 0 < len(sid) <= MAX_SESSION_ID_CHARS and _ID.fullmatch(sid) is not None


def check_session_id(sid: str) -> None:
    """Raise :class:`InvalidSessionError` unless ``sid`` is a :func:`valid_session_id`."""
    if not valid_session_id(sid):
        shown = sid if len(sid) <= 80 else sid[:80] + "..."
        raise InvalidSessionError(
            f"invalid session id {shown!r}: use 1-{MAX_SESSION_ID_CHARS} characters from ASCII "
            "letters, digits, '-' and '_'"
        )


def valid_token(token: object) -> bool:
    """Whether ``token`` could be a session token: 1-512 visible ASCII characters (no spaces)."""
    return (isinstance(token, str) and 0 < len(token) <= MAX_TOKEN_CHARS
            and _TOKEN.fullmatch(token) is not None)


def check_token(token: str) -> None:
    """Raise :class:`InvalidSessionError` unless ``token`` is a :func:`valid_token`: a token an
    HTTP client cannot send as a header value as it is would lock its agent out."""
    if not valid_token(token):
        raise InvalidSessionError(
            f"invalid token: use at most {MAX_TOKEN_CHARS} visible ASCII characters (no spaces, no control "
            "or non-ASCII characters)"
        )
