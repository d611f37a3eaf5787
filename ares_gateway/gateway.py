"""The in-process gateway: an HTTP server for agents plus a Python API for the policy.

>>> async with Gateway() as gw:
...     info = await gw.create_session()
...     # point an agent at info.base_url with info.token, then:
...     req = await gw.next_request(session=info.session_id, timeout=60)
...     await gw.respond(req.id, Completion(text="hello"))
...     await gw.end_session(info.session_id, reward=1.0)

Every method that changes state (``create_session``, ``end_session``, ``delete_session``,
``respond``, ``next_request``) is a coroutine; the read-only ones (``session_summary``,
``trajectory``, ``turn_log``) are plain methods.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp.web_request import BaseRequest
from aiohttp.web_response import StreamResponse

from ares_gateway.core.answers import AnswerLike, ErrorAnswer
from ares_gateway.core.broker import Broker, ParkedRequest
from ares_gateway.core.canonical import (
    CanonicalRequest,
    Completion,
    CompletionDelta,
    TokenRecord,
    next_policy_version,
)
from ares_gateway.core.errors import InvalidSessionError, UnknownSessionError
from ares_gateway.core.fence import PauseReport, SamplingFence
from ares_gateway.core.metrics import GatewayMetrics
from ares_gateway.core.recorder import RecordedTurn, Recorder, token_counts
from ares_gateway.core.session_recorder import SessionRecorder
from ares_gateway.core.sessions import Session, SessionInfo, SessionRegistry, bearer_token, same_secret
from ares_gateway.core.store import TurnStore
from ares_gateway.http.app import build_server
from ares_gateway.http.body_parser import BodyParser
from ares_gateway.http.open_files import check_connections, raise_open_file_limit
from ares_gateway.http.server import HttpLimits, HttpServer
from ares_gateway.http.session_socket import SessionSockets
from ares_gateway.side_calls import SideCallDetector, default_side_call_detector
from ares_gateway.telemetry import Telemetry
from trajectory import Sample

log = logging.getLogger(__name__)

def _flag(help_text: str, name: str | None = None) -> dict[str, str]:
    """Field metadata: the field is an ``ares-gateway serve`` flag (``--NAME``, by default the field's
    name) with this help; its default is the field's."""
    return {"help": help_text, **({"flag": name} if name else {})}


@dataclass(slots=True)
class GatewayConfig:
    """Settings of one gateway (``Gateway(**fields)`` overrides any of them, the fields of
    :class:`HttpLimits` too); a field with a ``help`` in its metadata is an ``ares-gateway serve`` flag
    (docs/gateway.md lists them). Every limit has a safe default."""

    host: str = "127.0.0.1"
    port: int = 8080
    #: Guards /poll, /respond, /sessions* and /metrics. ``None``: :class:`Gateway` generates a random
    #: one (read it as ``Gateway.admin_token``), so no gateway serves an open control API.
    admin_token: str | None = None
    #: Seconds a parked request waits for its answer before the agent gets a 504.
    request_timeout: float = field(default=900.0, metadata=_flag("seconds a request waits for its answer"))
    #: Seconds a polled request stays leased to its poller before it is delivered again.
    lease_seconds: float = field(default=120.0, metadata=_flag(
        "seconds before an unanswered polled request is redelivered", "lease"))
    #: Requests one session may have waiting for the policy at once; more get a 429 in the agent's shape.
    max_parked_per_session: int = field(default=256, metadata=_flag(
        "requests one session may have waiting for the policy at once (more: 429)"))
    #: Body bytes one session's requests may hold at once, parked or still being read and parsed;
    #: more get a 429 in the agent's shape (a single body over it: 413). The gateway holds about
    #: five times a body's bytes while it is parked (its parsed JSON and canonical form).
    max_parked_bytes_per_session: int = field(default=64 * 1024 * 1024, metadata=_flag(
        "body bytes one session's waiting requests may hold (more: 429; one body over it: 413)"))
    #: Body bytes every session's requests together may hold at once (the same count, summed); more
    #: get a 429 in the agent's shape (a single body over it: 413). About five times this is resident.
    max_parked_bytes: int = field(default=1024 * 1024 * 1024, metadata=_flag(
        "body bytes every session's waiting requests together may hold (more: 429; one body over it: 413)"))
    #: Bodies of at least this many bytes are parsed off the event loop (a worker process decodes
    #: and checks them, a thread rebuilds them), so one agent's 30 MB body does not stall the others.
    parse_offload_bytes: int = field(default=1024 * 1024, metadata=_flag(
        "bodies of at least this many bytes are parsed off the event loop"))
    #: Convert only what each request adds to its session's previous one (found by comparing raw
    #: bytes): a long session's turn then costs what its new messages cost. Keeps each session's
    #: latest canonical messages and tools between turns (about the size of one parsed body).
    parse_reuse: bool = True
    #: Seconds a policy's stream (``respond`` with an async iterable) may send nothing before the
    #: agent's stream is ended with an error event (a non-streaming agent gets a 504).
    stream_idle_timeout: float = field(default=300.0, metadata=_flag(
        "seconds a policy's stream may send nothing before the agent's stream is ended"))
    #: Seconds between the SSE keep-alives (``: keep-alive`` comment lines) a parked streaming request
    #: gets while sampling is paused for a weight update, so its client's read timeout does not fire.
    pause_keepalive_seconds: float = field(default=10.0, metadata=_flag(
        "seconds between the keep-alives a parked streaming request gets while sampling is paused"))
    #: What one HTTP connection may send, and how slowly (:class:`HttpLimits` documents each field;
    #: ``config.max_headers`` and the like read and set them here).
    http: HttpLimits = field(default_factory=HttpLimits)
    #: Create a session on first use of an unknown session id or token (local experiments only).
    auto_sessions: bool = False
    #: Model ids listed by GET /v1/models.
    models: list[str] = field(default_factory=lambda: ["ares-gateway"])
    #: The URL agents reach the gateway at (default: http://host:port).
    public_url: str | None = None
    access_log: bool = False
    fork_threshold_tokens: int = 1024
    #: Where every answered turn and session is written as it happens (docs/recording.md).
    #: ``None``: a fresh temporary directory, removed by a clean :meth:`Gateway.close` (a crash
    #: leaves it, with its path in the log); ``False``: memory only, nothing written.
    data_dir: str | os.PathLike[str] | bool | None = None
    #: Free an ended session's in-memory state once its samples are built (the data dir keeps it).
    release_ended: bool = True
    #: At start, delete sessions that ended more than this many seconds ago from the data dir.
    retention_seconds: float | None = None
    #: Refuse to start when the data dir has less free space than this (MiB).
    min_free_mb: int = 64
    #: SQLite ``synchronous``: "NORMAL" (commit = write to the WAL; survives the process dying) or "FULL".
    store_sync: str = "NORMAL"
    #: ``POST /respond`` answers 200 only once its turns are committed to the data dir.
    wait_durable: bool = True
    #: Directory for the per-session agent sockets (default: a fresh 0700 temporary directory).
    runtime_dir: str | None = None


#: The names of :class:`HttpLimits`' fields, which ``Gateway(...)`` and a :class:`GatewayConfig` also
#: take and give as their own (each reads and sets ``config.http``).
HTTP_LIMIT_NAMES = tuple(f.name for f in dataclasses.fields(HttpLimits))


def _http_limit(name: str) -> property:
    def get(self: GatewayConfig) -> Any:
        return getattr(self.http, name)

    def set_(self: GatewayConfig, value: Any) -> None:
        self.http = dataclasses.replace(self.http, **{name: value})  # checked by HttpLimits

    return property(get, set_, doc=f"``http.{name}`` (:class:`HttpLimits`).")


for _name in HTTP_LIMIT_NAMES:
    setattr(GatewayConfig, _name, _http_limit(_name))


class Gateway:
    """One gateway: sessions, the broker of parked requests, the HTTP server and the recorder.

    Use as ``async with Gateway(...) as gw``. Agents talk HTTP to
    ``gw.base_url``; the policy answers either over HTTP (``/poll`` +
    ``/respond``) or through :meth:`next_request` / :meth:`respond`.
    """

    def __init__(
        self,
        config: GatewayConfig | None = None,
        *,
        recorder: Recorder | None = None,
        side_call_detector: SideCallDetector | None = default_side_call_detector,
        telemetry: Telemetry | bool | None = None,
        **overrides: Any,
    ) -> None:
        cfg = config or GatewayConfig()
        for key, value in overrides.items():
            if not hasattr(cfg, key):
                raise TypeError(f"Gateway() got an unknown setting {key!r}")
            setattr(cfg, key, value)
        if cfg.admin_token is None:
            # Never an open control API, as `serve` and `run` do: whoever reaches the port
            # (an agent with the host's network, another user of the host) could read every request
            # and answer or end any session. The owner reads it as self.admin_token.
            cfg.admin_token = secrets.token_urlsafe(32)
        elif not isinstance(cfg.admin_token, str) or not cfg.admin_token.strip():
            raise ValueError("admin_token must be a non-empty string (or None: a random one is generated)")
        self.config = cfg
        self.sessions = SessionRegistry(on_create=self._session_created)
        #: The durable store (opened by :meth:`start`; ``None`` for a memory-only gateway or before start).
        self.store: TurnStore | None = None
        self._temp_data_dir: str | None = None
        self.metrics = GatewayMetrics()
        # Turns are recorded after their answer went out (defer): reads, durable() and close() drain first.
        self.recorder = SessionRecorder(fork_threshold_tokens=cfg.fork_threshold_tokens, defer=True)
        self._extra_recorder = recorder
        #: OpenTelemetry spans (:mod:`ares_gateway.telemetry`): ``None`` (the default) as the ``OTEL_*``
        #: environment asks, ``True`` on, ``False`` off, or a :class:`Telemetry` of the caller's.
        self.telemetry: Telemetry | None = (
            telemetry if isinstance(telemetry, Telemetry) else Telemetry.from_env(enabled=telemetry))
        self._side_call_detector = side_call_detector
        self.broker = Broker(
            request_timeout=cfg.request_timeout,
            lease_seconds=cfg.lease_seconds,
            # Straight to the session recorder unless another one listens too (one call fewer a turn).
            on_turn=self._on_turn,
            metrics=self.metrics,
            max_parked_per_session=cfg.max_parked_per_session,
            max_parked_bytes_per_session=cfg.max_parked_bytes_per_session,
            max_parked_bytes=cfg.max_parked_bytes,
        )
        if cfg.parse_offload_bytes < 1:
            raise ValueError("parse_offload_bytes must be at least 1")
        #: Parses agents' bodies, the large ones off the event loop.
        self.body_parser = BodyParser(offload_bytes=cfg.parse_offload_bytes)
        if not cfg.stream_idle_timeout > 0:
            raise ValueError("stream_idle_timeout must be a positive number of seconds")
        #: What one HTTP connection may send, and how slowly (from the config).
        self.limits = cfg.http
        self._http: HttpServer | None = None
        self._port: int | None = None
        #: Applications served under a path prefix (:meth:`mount`).
        self.mounts: dict[str, Callable[[BaseRequest], Awaitable[StreamResponse]]] = {}
        #: Per-session agent endpoints on unix sockets (:meth:`agent_socket`), for sandboxes without a
        #: network.
        self.session_sockets = SessionSockets(self, self.limits, root=cfg.runtime_dir)
        if not cfg.pause_keepalive_seconds > 0:
            raise ValueError("pause_keepalive_seconds must be a positive number of seconds")
        #: The weight-update fence (:meth:`pause_sampling`, :meth:`resume_sampling`, :meth:`weight_update`).
        self.fence = SamplingFence(self.broker, on_fence=self._fenced)
        self.metrics.fence_paused_now = lambda: self.fence.paused
        self.metrics.parked_bytes_now = lambda: self.broker.parked_bytes
        #: Called with ("pause" | "resume", scalars) as each fence completes (a run's stats tracker).
        self.fence_listeners: list[Callable[[str, dict[str, float]], None]] = []

    def mount(self, prefix: str, handler: Callable[[BaseRequest], Awaitable[StreamResponse]]) -> None:
        """Serve ``handler`` for ``prefix`` and every path below it (``/ui``: the trajectory viewer,
        :mod:`ares_gateway.viewer`), beside the gateway's own paths, which it cannot shadow. The
        handler does its own authentication; its ``close()``, if it has one, is called when the gateway
        closes, before the server waits for the requests in flight."""
        if not prefix.startswith("/") or prefix.endswith("/") or prefix in ("/s", "/sessions", "/v1"):
            raise ValueError(f"cannot mount at {prefix!r}: a prefix like /ui")
        self.mounts[prefix] = handler

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start serving HTTP (idempotent). Raises the process's soft open-file limit to its hard limit
        (the default connection cap follows it) and warns when ``max_connections`` does not fit it."""
        if self._http is not None:
            return
        if self.store is None and self.config.data_dir is not False:
            self._open_store()
        # Each connection is a descriptor: a soft limit of 1024 would cap the gateway far below its load.
        raise_open_file_limit()
        if self.config.http.max_connections is not None:
            warning = check_connections(self.config.http.max_connections)
            if warning:
                log.warning("%s", warning)
        http = build_server(self, self.limits, self.mounts)
        self._port = await http.start(self.config.host, self.config.port)
        self._http = http
        log.info("ares-gateway listening on %s", self.url)

    async def close(self) -> None:
        """Fail every parked request and stop serving."""
        self.broker.close()
        if self.telemetry is not None:  # its flush posts to the collector: off the event loop
            await asyncio.to_thread(self.telemetry.shutdown)
        store, self.store = self.store, None
        self.recorder.detach_store()
        if store is not None:
            store.close()
        if self._temp_data_dir is not None:
            shutil.rmtree(self._temp_data_dir, ignore_errors=True)
            self._temp_data_dir = None
        await self.session_sockets.close_all()
        for mounted in self.mounts.values():
            closer = getattr(mounted, "close", None)
            if callable(closer):
                closer()  # e.g. the viewer ends its live-update streams, which would hold the server's grace
        if self._http is not None:
            http, self._http = self._http, None
            await http.close()
        self.body_parser.close()

    def _open_store(self) -> None:
        # Never a silent in-memory fallback: a data dir that cannot be used is a start-up error.
        cfg = self.config
        path = cfg.data_dir
        if path is None or path is True:
            path = self._temp_data_dir = tempfile.mkdtemp(prefix="ares-gateway-data-")
        assert not isinstance(path, bool)
        store = TurnStore(path, min_free_bytes=cfg.min_free_mb * 2**20, synchronous=cfg.store_sync)
        try:
            if cfg.retention_seconds is not None:
                gone = store.prune(ended_before=time.time() - cfg.retention_seconds)
                if gone:
                    log.info("data dir %s: pruned %d session(s) past retention", store.path, len(gone))
            stored = store.load_sessions()
        except BaseException:
            store.close()
            raise
        for s in stored:
            if self.sessions.find(s.id) is not None:
                continue
            session = self.sessions.restore(
                s.id, token=s.token, created_at=s.created_at, metadata=s.metadata, turns=s.turns
            )
            if s.ended:
                session.end(reward=s.reward, truncated=s.truncated, info=s.end_info)
        self.recorder.known({s.id for s in stored if s.turns})
        self.recorder.store = self.store = store
        self.metrics.turns_lost = lambda: store.lost_turns
        log.info("recording to data dir %s (%d session(s) known)", store.path, len(stored))

    @property
    def data_dir(self) -> str | None:
        """The data directory being written, or ``None`` (memory only, or not started)."""
        return None if self.store is None else str(self.store.path)

    async def durable(self) -> None:
        """Return once every turn answered so far is committed to the data dir (at once without one).

        Raises :class:`~ares_gateway.core.errors.DataDirError` when writing failed (the disk is full).
        """
        self.recorder.drain()  # the turns answered in this loop iteration go to the store first
        if self.store is not None:
            await self.store.barrier()

    def _session_created(self, session: Session) -> None:
        if self.store is not None:
            self.store.put_session(session.id, session.token, session.created_at, session.metadata)

    async def __aenter__(self) -> Gateway:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def admin_token(self) -> str:
        """The token the control API (``/poll``, ``/respond``, ``/sessions*``, ``/metrics``) requires, as
        ``Authorization: Bearer <token>``: the one given, or the one generated. A secret: never log it."""
        token = self.config.admin_token
        assert token is not None  # set in __init__
        return token

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError(
                "the gateway is not started; use `async with Gateway() as gw` or await gw.start()")
        return self._port

    @property
    def url(self) -> str:
        """The gateway's root URL as agents reach it."""
        if self.config.public_url:
            return self.config.public_url.rstrip("/")
        host = self.config.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    # ------------------------------------------------------------------ sessions

    async def create_session(
        self, session_id: str | None = None, *, metadata: dict[str, Any] | None = None,
        token: str | None = None
    ) -> SessionInfo:
        """Create a session; give the agent ``base_url`` and ``token``.

        Raises :class:`~ares_gateway.core.errors.SessionExistsError` (409) for an id or token in use and
        :class:`~ares_gateway.core.errors.InvalidSessionError` (400) for an unusable one.
        """
        if session_id is not None and not isinstance(session_id, str):
            raise InvalidSessionError("session_id must be a string")
        if metadata is not None and not isinstance(metadata, dict):
            raise InvalidSessionError("metadata must be a JSON object")
        if token is not None and (not isinstance(token, str) or len(token) < 16):
            raise InvalidSessionError("token must be a string of at least 16 characters")
        if metadata:
            try:  # it is written to the data dir and served by GET /sessions: it must encode
                orjson.dumps(metadata, default=str)  # as the store writes it
            except TypeError as exc:  # orjson.JSONEncodeError: nested too deep, not JSON, not UTF-8
                raise InvalidSessionError(f"metadata cannot be stored as JSON: {exc}") from None
        session = self.sessions.create(session_id, token=token, metadata=metadata)
        return self._info(session)

    def _info(self, session: Session) -> SessionInfo:
        return SessionInfo(session.id, session.token, f"{self.url}/s/{session.id}")

    def session_summary(self, session_id: str) -> dict[str, Any]:
        session = self.sessions.get(session_id)
        out = {**session.summary(), "pending": self.broker.pending_for(session_id)}
        damaged = self.recorder.damaged.get(session_id)
        if damaged:
            out["damaged_records"] = [{"turn": d.seq, "reason": d.reason} for d in damaged]
        return out

    async def end_session(
        self, session_id: str, *, reward: float | None = None, truncated: bool = False, **info: Any
    ) -> None:
        """Mark a session's episode as over: a waiting :class:`GatewayEnv` returns LAST.

        Requests the agent still has parked stay answerable; new ones get a 409.
        """
        self.end_session_nowait(session_id, reward=reward, truncated=truncated, **info)

    def end_session_nowait(
        self, session_id: str, *, reward: float | None = None, truncated: bool = False, **info: Any
    ) -> None:
        """:meth:`end_session` for code that cannot await (a task's done callback, a sync helper);
        the same effect, at once."""
        session = self.sessions.get(session_id)
        session.end(reward=reward, truncated=truncated, info=info)
        if self.store is not None:
            self.store.end_session(session_id, reward=reward, truncated=truncated, end_info=session.end_info,
                                   ended_at=time.time())

    async def delete_session(self, session_id: str) -> int:
        """Forget a session: its pending requests fail (the agent sees 503) and its records go.
        Returns how many requests were pending."""
        session = self.sessions.remove(session_id)
        if not session.ended:
            session.end()
        self.recorder.drop(session_id)
        if self.store is not None:
            self.store.delete_session(session_id)
        await self.session_sockets.close(session_id)
        return self.broker.close_session(session_id)

    async def agent_socket(self, session_id: str) -> str:
        """Serve ``session_id``'s agent endpoints (the LLM APIs only, as that session) on its own unix
        socket, ``<runtime_dir>/<session id>/agent.sock``, and return its path. A sandbox without a
        network reaches it through ``Sandbox.forward``; it closes with :meth:`delete_session`."""
        return await self.session_sockets.open(session_id)

    # ------------------------------------------------------------------ policy API

    @property
    def policy_version(self) -> int | None:
        """The version of the weights the policy samples with now, as the trainer last set it with
        :meth:`set_policy_version` (``None``: never set). Each request is stamped with it when it is
        handed to the policy; a turn whose engine or policy reports a version of its own keeps that."""
        return self.broker.policy_version

    def set_policy_version(self, version: int) -> None:
        """Say which weights the policy samples with from now on: a non-negative integer, never lower
        than the last one set (the same again is a no-op). Requests already handed to the policy keep
        the version they were stamped with. Raises
        :class:`~ares_gateway.core.errors.InvalidPolicyVersionError` (400) for anything but a
        non-negative integer and :class:`~ares_gateway.core.errors.PolicyVersionBackwardsError` (409)
        for a version lower than the current one."""
        self.broker.policy_version = next_policy_version(version, self.broker.policy_version)

    # ------------------------------------------------------------------ weight-update fence

    async def pause_sampling(self, mode: str = "drain", *, timeout: float | None = None) -> PauseReport:
        """Stop handing requests to the policy for a weight update; return once no generation is in flight.

        Every agent request stays parked meanwhile (agents see latency, streaming ones SSE keep-alives).
        ``mode="drain"`` (the default) waits for the generations in flight to finish and be answered;
        ``mode="abort"`` cancels the in-process ones (run through :meth:`SamplingFence.generate
        <ares_gateway.core.fence.SamplingFence.generate>`, as :class:`~ares_gateway.PolicyServer` and
        ``run`` do), which sample again after the resume, and takes back the requests leased to pollers,
        whose answers are then refused (409). ``timeout``: seconds the drain may take (``None``: no
        limit). Raises :class:`~ares_gateway.core.errors.SamplingPausedError` when paused already,
        :class:`~ares_gateway.core.errors.InvalidFenceError` for a bad mode or timeout and
        :class:`~ares_gateway.core.errors.DrainTimeoutError` when the drain outlasts ``timeout`` (sampling
        is then resumed). The pause's time does not count against ``request_timeout``."""
        report = await self.fence.pause(mode, timeout)
        self.metrics.fence_paused(report.drain_seconds)
        return report

    def resume_sampling(self, version: int | None = None) -> float:
        """Hand requests to the policy again, after :meth:`pause_sampling` returned; ``version``: the
        version of the weights now loaded (set with :meth:`set_policy_version` before anything is handed
        out; a bad or lower version raises and leaves sampling paused). Returns the seconds it was paused.
        Raises :class:`~ares_gateway.core.errors.SamplingNotPausedError` without a pause that returned."""
        if self.fence.state != "paused":
            self.fence.resume()  # raises the reason
        if version is not None:
            self.set_policy_version(version)
        paused_for = self.fence.resume()
        self.metrics.fence_resumed(paused_for)
        return paused_for

    @asynccontextmanager
    async def weight_update(
        self, version: int | None = None, *, mode: str = "drain", timeout: float | None = None
    ) -> AsyncIterator[PauseReport]:
        """``async with gw.weight_update(version):`` pause (as :meth:`pause_sampling`), mutate the weights
        in the body, resume with ``version`` on exit. Resumes even when the body raises (without the new
        version then: the weights may be half updated, and the caller decides what they are)."""
        report = await self.pause_sampling(mode, timeout=timeout)
        try:
            yield report
        except BaseException:
            self.resume_sampling()
            raise
        self.resume_sampling(version)

    def _fenced(self, kind: str, scalars: dict[str, float]) -> None:
        for listener in list(self.fence_listeners):
            try:
                listener(kind, scalars)
            except Exception:  # a stats writer failing must not break the fence
                log.warning("a fence listener failed", exc_info=True)

    async def next_request(
        self, session: str | None = None, *, timeout: float | None = None, lease: float | None = None
    ) -> ParkedRequest | None:
        """The next parked request (of one session, or any), or ``None`` after ``timeout`` seconds.

        In process there is no lease by default (``lease=None``): the request stays
        with the caller until answered. ``timeout=None`` waits indefinitely.
        """
        if session is not None and self.sessions.find(session) is None:
            raise UnknownSessionError(f"no session {session!r}")
        wait = 10**9 if timeout is None else timeout
        got = await self.broker.poll(session, max_items=1, wait=wait, lease=lease)
        return got[0] if got else None

    async def respond(
        self,
        request_id: str,
        answer: Completion | dict[str, Any] | ErrorAnswer | AsyncIterable[CompletionDelta | Completion] | str,
        *,
        tokens: TokenRecord | dict[str, Any] | None = None,
        policy_version: int | None = None,
    ) -> None:
        """Answer a parked request.

        ``answer`` is a :class:`Completion`, a native response body of the agent's
        protocol (dict), an :class:`ErrorAnswer`, a plain string (a text reply),
        or an async iterable of :class:`CompletionDelta` ending with a
        :class:`Completion` (streamed to the agent as it arrives).
        Raises :class:`~ares_gateway.core.errors.UnknownRequestError` (404),
        :class:`~ares_gateway.core.errors.AlreadyAnsweredError` (409),
        :class:`~ares_gateway.core.errors.RequestGoneError` (410: the agent disconnected, even in
        this very loop iteration, or the request timed out) or
        :class:`~ares_gateway.core.errors.InvalidAnswerError` (400).

        ``policy_version``: the version of the weights that sampled the answer, when the policy
        knows it (a non-negative integer; else
        :class:`~ares_gateway.core.errors.InvalidPolicyVersionError`, 400). A completion's own
        ``policy_version`` comes first; without either the turn takes the gateway's
        :attr:`policy_version` as it was when the request was handed to the policy.
        """
        self.answer(request_id, answer, tokens=tokens, policy_version=policy_version)

    def answer(
        self,
        request_id: str,
        answer: AnswerLike,
        *,
        tokens: TokenRecord | dict[str, Any] | None = None,
        policy_version: int | None = None,
    ) -> None:
        """:meth:`respond`, without awaiting: the one respond path, which ``/respond`` takes too. The
        answer and its token ids are read once, by the broker (``core.answers.coerce_answer``)."""
        # No wait for the data dir here: the turn is queued and committed within milliseconds; a
        # caller that needs it on disk awaits durable() (/respond does, before its 200).
        self.broker.respond(request_id, answer, tokens=tokens, policy_version=policy_version)

    def trajectory(
        self, session_id: str, *, reward: float | None = None, max_sample_tokens: int = 0
    ) -> list[Sample]:
        """Training samples of a session (turns answered with token records)."""
        session = self.sessions.get(session_id)
        if reward is None:
            reward = session.reward or 0.0
        samples = self.recorder.samples(session_id, reward=reward, max_sample_tokens=max_sample_tokens)
        if session.ended and self.config.release_ended:
            # Retention: the samples are out, the data dir has the rest; memory goes.
            self.recorder.release(session_id)
        return samples

    def turn_log(self, session_id: str, *, tokens: bool = True) -> list[dict[str, Any]]:
        """The session's turns: native request, completion (with its token record unless
        ``tokens=False``), timing, side-call flag, sampling parameters."""
        self.sessions.get(session_id)
        return self.recorder.turn_log(session_id, tokens=tokens)

    # ------------------------------------------------------------------ internals

    def admin_ok(self, headers: Mapping[str, str]) -> bool:
        """Whether ``headers`` carry the admin token (as ``Authorization: Bearer`` or ``x-admin-token``).

        Any header value is simply right or wrong: one that is not UTF-8 is wrong, not a 500."""
        given = bearer_token(headers) or headers.get("x-admin-token", "")
        return same_secret(given, self.admin_token)

    def is_side_call(self, session: Session, request: CanonicalRequest, headers: Mapping[str, str]) -> bool:
        if headers.get("x-ares-side-call", "").lower() in ("1", "true", "yes"):
            return True
        detector = self._side_call_detector
        return bool(detector and detector(request, headers))

    def _on_turn(self, turn: RecordedTurn) -> None:
        # The one turn counter: a turn is counted where it is recorded (an error answer is no turn;
        # a streamed one counts once its stream ended), as a restart counts the turns it reads back.
        session = self.sessions.find(turn.session_id)
        if session is not None:
            session.turns += 1
        prompt_tokens, completion_tokens = token_counts(turn.completion)
        self.metrics.turn(parked=turn.parked_seconds, policy=turn.policy_seconds, ttft=turn.ttft,
                          prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
        self.recorder(turn)
        if self.telemetry is not None:
            try:
                self.telemetry(turn)
            except Exception:  # a span is never worth the agent's turn
                log.exception("OpenTelemetry span failed for %s", turn.request_id)
        if self._extra_recorder is not None:
            self._extra_recorder(turn)
