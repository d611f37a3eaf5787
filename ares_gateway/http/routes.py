"""The gateway's route table, looked up with one dict access per request.

The gateway serves a fixed set of paths, so a dict lookup finds a handler; a
general router (``aiohttp.web``'s walks every prefix of the path and runs a regex
per candidate, then wraps the request in match-info and middleware machinery) came
to about 13% of the instructions of a whole agent turn (docs/performance.md).

Three kinds of path:

* agent paths, served at the root and under ``/s/{sid}`` (``sid`` is then the session);
* control paths at the root (``/poll``, ``/respond``, ...);
* session control paths under ``/sessions/{sid}``.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp.web_request import BaseRequest
from aiohttp.web_response import StreamResponse

#: A route's handler: the request and the ``{sid}`` of its path (``None`` when it has none).
Handler = Callable[[BaseRequest, str | None], Awaitable[StreamResponse]]
#: A mounted application: every path under its prefix (``/ui`` and ``/ui/...``), the request alone.
MountHandler = Callable[[BaseRequest], Awaitable[StreamResponse]]
#: Answers what no route takes: (request, allowed methods of the path, empty when the path is unknown).
Fallback = Callable[[BaseRequest, frozenset[str]], Awaitable[StreamResponse]]


@dataclass
class RouteTable:
    """Method and path to handler, for the three kinds of path the gateway serves."""

    fallback: Fallback
    agent: dict[str, dict[str, Handler]] = field(default_factory=dict)
    control: dict[str, dict[str, Handler]] = field(default_factory=dict)
    session: dict[str, dict[str, Handler]] = field(default_factory=dict)
    #: Prefix to handler, looked at only for paths no route takes (the known paths pay nothing);
    #: shared with its owner, so a mount added after the server started is served too.
    mounts: dict[str, MountHandler] = field(default_factory=dict)

    def add_agent(self, methods: str, path: str, handler: Handler) -> None:
        """``path`` relative to the session base URL: ``""`` is the base itself, ``"/"`` its root."""
        _add(self.agent, methods, path, handler)

    def add_control(self, methods: str, path: str, handler: Handler) -> None:
        _add(self.control, methods, path, handler)

    def add_session(self, methods: str, suffix: str, handler: Handler) -> None:
        """A path ``/sessions/{sid}`` + ``suffix``."""
        _add(self.session, methods, suffix, handler)

    def __call__(self, request: BaseRequest) -> Awaitable[StreamResponse]:
        # A plain function handing back the handler's coroutine: one coroutine frame fewer
        # for every step of every request.
        path = request.path
        if "//" in path:  # a base URL configured with a trailing slash, joined with "/v1/...": as nginx does
            path = _SLASHES.sub("/", path)
        sid: str | None = None
        if path.startswith("/s/"):
            sid, slash, rest = path[3:].partition("/")
            table, key = self.agent, slash + rest
        elif path.startswith("/sessions/"):
            sid, slash, rest = path[10:].partition("/")
            table, key = self.session, slash + rest
        else:
            table, key = (self.control, path) if path in self.control else (self.agent, path)
        methods = table.get(key) if sid != "" else None
        if methods is None:
            for prefix, mounted in self.mounts.items():
                if path == prefix or path.startswith(prefix + "/"):
                    return mounted(request)
            return self.fallback(request, frozenset())
        handler = methods.get(request.method)
        if handler is None:
            return self.fallback(request, frozenset(methods))
        return handler(request, sid)


_SLASHES = re.compile("/{2,}")


def _add(table: dict[str, dict[str, Handler]], methods: str, path: str, handler: Handler) -> None:
    slot = table.setdefault(path, {})
    for method in methods.split(","):
        if method in slot:
            raise ValueError(f"two handlers for {method} {path!r}")
        slot[method] = handler
