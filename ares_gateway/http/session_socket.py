"""One session's agent endpoint on its own unix socket (the sandbox relay's far end).

A sandbox with ``network="none"`` reaches nothing but its own loopback; a relay inside it forwards
``127.0.0.1:PORT`` to the unix socket this module serves for that one session
(``<runtime dir>/<session id>/agent.sock``). The socket answers only the agent paths of
:func:`~ares_gateway.http.app.build_routes` (the LLM APIs, the ``HEAD`` probe, models,
count_tokens), always as that session:

* ``/s/<its id>/...`` and the root paths (``/v1/messages``, ...) are served as the session; the
  session token is still checked, as on the TCP port;
* ``/s/<another id>/...`` is a 404, and so is every control path (``/poll``, ``/respond``,
  ``/sessions``, ``/metrics``, ``/healthz``): the control API does not exist on this socket.

The directory is ``0700`` and the socket ``0600``, both the gateway's user's: only that user (the
relays run as root on the host, or as root in a container whose mount is that directory) can
connect. Who may connect decides which session it is; nothing an agent sends can change it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

from aiohttp.web_request import BaseRequest
from aiohttp.web_response import StreamResponse

from ares_gateway.core.sessions import valid_session_id
from ares_gateway.http.app import build_routes
from ares_gateway.http.render import error_for_path
from ares_gateway.http.served import ServedGateway
from ares_gateway.http.server import HttpLimits, HttpServer

log = logging.getLogger(__name__)

#: The socket's name inside the session's directory.
SOCKET_NAME = "agent.sock"
_SLASHES = re.compile("/{2,}")
# sun_path holds 108 bytes on Linux, its NUL included; leave room for "/<session id>/agent.sock".
_MAX_SOCKET_PATH = 107
_MAX_ROOT = 60


class SessionSocketError(Exception):
    """A session's agent socket could not be opened."""


class SessionSockets:
    """The per-session agent sockets of one gateway, under one runtime directory.

    ``root`` (default: a fresh ``0700`` directory under ``$XDG_RUNTIME_DIR`` or the temp dir) holds
    one ``0700`` directory per session. :meth:`open` is idempotent per session; :meth:`close` and
    :meth:`close_all` stop the listeners and remove their directories.
    """

    def __init__(self, gateway: ServedGateway, limits: HttpLimits, *,
                 root: str | os.PathLike[str] | None = None) -> None:
        self._gw = gateway
        self._limits = limits
        self._root_arg = Path(root) if root is not None else None
        self._root: Path | None = None
        self._owns_root = root is None
        self._servers: dict[str, tuple[HttpServer, Path]] = {}
        self._lock = asyncio.Lock()

    @property
    def root(self) -> Path:
        """The runtime directory (created on first use)."""
        if self._root is None:
            if self._root_arg is not None:
                self._root_arg.mkdir(mode=0o700, parents=True, exist_ok=True)
                self._root = self._root_arg
            else:
                base = os.environ.get("XDG_RUNTIME_DIR")
                if not base or not os.path.isdir(base) or len(base) > _MAX_ROOT - 20:
                    base = None
                self._root = Path(tempfile.mkdtemp(prefix="ares-gw-", dir=base))
            os.chmod(self._root, 0o700)
            if len(str(self._root)) > _MAX_ROOT:
                raise SessionSocketError(
                    f"runtime directory {self._root} is too long for unix sockets (at most {_MAX_ROOT} "
                    "characters): pass a shorter one"
                )
        return self._root

    def path(self, session_id: str) -> str | None:
        """The socket of ``session_id``, if one is open."""
        got = self._servers.get(session_id)
        return str(got[1] / SOCKET_NAME) if got is not None else None

    async def open(self, session_id: str) -> str:
        """Serve ``session_id``'s agent endpoints on its own socket; returns the socket's path."""
        async with self._lock:
            known = self.path(session_id)
            if known is not None:
                return known
            if self._gw.sessions.find(session_id) is None:
                raise SessionSocketError(
                    f"no session {session_id!r}: create it before opening its agent socket")
            # The id names a directory that is removed below: "." or ".." would be the runtime
            # dir itself or its parent (the system's temp dir). New ids are checked at creation;
            # this also holds for a session restored from an older data dir.
            if not valid_session_id(session_id):
                raise SessionSocketError(
                    f"session id {session_id!r} cannot name a directory: no agent socket for it")
            directory = self.root / session_id
            if directory.parent != self.root:
                raise SessionSocketError(
                    f"session id {session_id!r} cannot name a directory: no agent socket for it")
            path = str(directory / SOCKET_NAME)
            if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
                raise SessionSocketError(
                    f"the agent socket path {path} is longer than unix sockets allow "
                    f"({_MAX_SOCKET_PATH} bytes): "
                    "use a shorter session id or runtime_dir"
                )
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(directory)
            directory.mkdir(mode=0o700)
            os.chmod(directory, 0o700)
            server = build_session_server(self._gw, self._limits, session_id)
            try:
                await server.start_unix(path, mode=0o600)
            except OSError as exc:
                shutil.rmtree(directory, ignore_errors=True)
                raise SessionSocketError(f"cannot listen on {path}: {exc}") from exc
            self._servers[session_id] = (server, directory)
            return path

    async def close(self, session_id: str) -> None:
        """Stop serving ``session_id``'s socket and remove its directory (nothing if none is open)."""
        got = self._servers.pop(session_id, None)
        if got is None:
            return
        server, directory = got
        try:
            await server.close(grace=1.0)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    async def close_all(self) -> None:
        """Close every socket, and remove the runtime directory when this object made it."""
        for sid in list(self._servers):
            try:
                await self.close(sid)
            except Exception as exc:  # the others must still close
                log.warning("closing the agent socket of session %s failed: %s", sid, exc)
        if self._owns_root and self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    def __len__(self) -> int:
        return len(self._servers)


def build_session_server(gateway: ServedGateway, limits: HttpLimits, session_id: str) -> HttpServer:
    """An HTTP server (not yet listening) for the agent paths of ``session_id`` only."""
    routes = build_routes(gateway, limits)
    agent = routes.agent
    fallback = routes.fallback
    own = f"/s/{session_id}"

    async def dispatch(request: BaseRequest) -> StreamResponse:
        expect = request.headers.get("expect")
        if expect is not None and request.version >= (1, 1) and expect.lower() != "100-continue":
            resp = error_for_path(request.path, 417,
                                  f"unknown Expect: {expect!r}; only 100-continue is supported")
            resp.force_close()
            return resp
        path = request.path
        if "//" in path:
            path = _SLASHES.sub("/", path)
        if path.startswith("/s/"):
            if path != own and not path.startswith(own + "/"):
                # Another session's path (or the control API's): this socket serves one session only.
                return await fallback(request, frozenset())
            key = path[len(own):]
        else:
            key = path
        methods = agent.get(key)
        if methods is None:
            return await fallback(request, frozenset())
        handler = methods.get(request.method)
        if handler is None:
            return await fallback(request, frozenset(methods))
        return await handler(request, session_id)

    return HttpServer(dispatch, error_for_path, limits, access_log=gateway.config.access_log)


__all__ = ["SOCKET_NAME", "SessionSocketError", "SessionSockets", "build_session_server"]
