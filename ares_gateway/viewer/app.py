"""The viewer's HTTP side: its pages, its JSON API, live updates (server-sent events), and its login.

One handler, ``Viewer(source)``, serves every path under ``/ui``: by ``ares-gateway view`` on its own
aiohttp server (:func:`serve_viewer`), or mounted into a gateway (``Gateway.mount("/ui", viewer)``)
by ``serve`` and ``run``, where it sits behind the admin token: ``POST /ui/login`` with the token in
the form body sets an HttpOnly, SameSite=Strict cookie (a random id, never the token), so the token is
in no URL, no history and no access log line.

``ares-gateway view`` does the same with a token of its own, generated at start: the URL it prints
carries it in the fragment (``/ui/#token=...``), which browsers never send; ``static/login.js`` takes
it out of the address bar and history and posts it through the login form.

Everything shown came from an agent or a model: the page builds its DOM with ``textContent`` only,
and every response carries a Content-Security-Policy that allows no inline script and nothing from
another origin. The viewer only reads.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import urllib.parse
from collections.abc import Callable
from importlib import resources
from typing import Any

import orjson
from aiohttp import web
from aiohttp.web_request import BaseRequest
from aiohttp.web_response import StreamResponse

from ares_gateway.core.sessions import bearer_token, same_secret
from ares_gateway.viewer.source import NotFound, RunSource

log = logging.getLogger("ares_gateway.viewer")

PREFIX = "/ui"
COOKIE = "ares_ui"
#: Seconds between two looks for news by a live-updates stream (a new turn shows within ~this).
LIVE_POLL_S = 0.2
#: Seconds a login cookie is good for.
LOGIN_TTL_S = 12 * 3600.0

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
_HEADERS = {"content-security-policy": CSP, "x-content-type-options": "nosniff",
            "referrer-policy": "no-referrer", "x-frame-options": "DENY", "cache-control": "no-store"}
_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".png": "image/png",
          ".svg": "image/svg+xml"}

_LOGIN = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>ares-gateway viewer: log in</title>
<link rel="stylesheet" href="/ui/static/viewer.css"><script src="/ui/static/login.js" defer></script></head>
<body><main class="login"><h1>ares-gateway viewer</h1>
<form method="post" action="/ui/login" id="login">
<label>Admin token <input type="password" name="token" autocomplete="current-password" autofocus></label>
<button type="submit">Log in</button></form>
<p class="hint">The admin token whose file <code>serve</code> or <code>run</code> printed (or the one they
were given); <code>view</code> prints a URL that logs in by itself.</p>
{error}</main></body></html>
"""


def _static() -> dict[str, tuple[bytes, str]]:
    """The page's files, from the package (``static/``), by name."""
    out: dict[str, tuple[bytes, str]] = {}
    for item in resources.files("ares_gateway.viewer").joinpath("static").iterdir():
        name = item.name
        ext = name[name.rfind("."):]
        if item.is_file() and ext in _TYPES:
            out[name] = (item.read_bytes(), _TYPES[ext])
    return out


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data, default=str, option=orjson.OPT_NON_STR_KEYS), status=status,
                        content_type="application/json", headers=_HEADERS)


def _redirect(location: str) -> web.Response:
    return web.Response(status=303, headers={**_HEADERS, "location": location})


def _plain(status: int, text: str, **headers: str) -> web.Response:
    return web.Response(status=status, text=text, headers={**_HEADERS, **headers})


def _int(query: Any, name: str, default: int) -> int:
    try:
        return int(query.get(name, default))
    except (TypeError, ValueError):
        return default


class Viewer:
    """Serves the viewer of ``source`` under ``/ui``.

    Args:
        source: what is shown.
        admin_token: every page and API call needs the login cookie (``POST /ui/login`` with this
            token) or ``Authorization: Bearer <token>``; ``None``: open (an in-process bench).
    """

    def __init__(self, source: RunSource, *, admin_token: str | None = None) -> None:
        self.source = source
        self.admin_token = admin_token
        self._logins: dict[str, float] = {}  # cookie value -> expiry
        self._files = _static()
        self._closing = asyncio.Event()

    def close(self) -> None:
        """End the live-update streams and let the data go (the server is stopping)."""
        self._closing.set()
        self.source.close()

    # ------------------------------------------------------------------ auth

    def _authorized(self, request: BaseRequest) -> bool:
        if self.admin_token is None:
            return True
        given = bearer_token(request.headers)
        if given is not None:
            return same_secret(given, self.admin_token)
        cookie = request.cookies.get(COOKIE)
        expiry = self._logins.get(cookie) if cookie else None
        return expiry is not None and expiry > time.time()

    async def _login(self, request: BaseRequest) -> StreamResponse:
        if self.admin_token is None:
            return _redirect(PREFIX + "/")
        if (request.content_length or 0) > 4096:
            return self._login_page("That is not a token.", 400)
        body = await request.read()
        if len(body) > 4096:
            return self._login_page("That is not a token.", 400)
        form = urllib.parse.parse_qs(body.decode("utf-8", "replace"))
        token = (form.get("token") or [""])[0].strip()
        if not token or not same_secret(token, self.admin_token):
            log.warning("viewer: a login with a wrong token from %s", request.remote)
            return self._login_page("Wrong token.", 401)
        now = time.time()
        self._logins = {k: v for k, v in self._logins.items() if v > now}
        cookie = secrets.token_urlsafe(32)
        self._logins[cookie] = now + LOGIN_TTL_S
        resp = web.Response(status=303, headers={**_HEADERS, "location": PREFIX + "/"})
        resp.set_cookie(COOKIE, cookie, path=PREFIX, httponly=True, samesite="Strict",
                        max_age=int(LOGIN_TTL_S))
        return resp

    def _login_page(self, error: str = "", status: int = 200) -> web.Response:
        # ``error`` is one of this module's fixed strings, never request data.
        html = _LOGIN.replace("{error}", f'<p class="error">{error}</p>' if error else "")
        return web.Response(text=html, status=status, content_type="text/html", headers=_HEADERS)

    # ------------------------------------------------------------------ dispatch

    async def __call__(self, request: BaseRequest) -> StreamResponse:
        try:
            return await self._dispatch(request)
        except NotFound as exc:
            return _json({"error": str(exc)}, 404)

    async def _dispatch(self, request: BaseRequest) -> StreamResponse:
        path, method = request.path, request.method
        if not path.startswith(PREFIX):
            return _plain(404, "Not Found")
        rest = path[len(PREFIX):]
        if rest == "":
            return _redirect(PREFIX + "/")
        if rest.startswith("/static/") and method in ("GET", "HEAD"):
            got = self._files.get(rest[len("/static/"):])
            if got is None:
                return _plain(404, "Not Found")
            return web.Response(body=got[0], content_type=got[1], headers=_HEADERS)
        if rest == "/login":
            if method == "POST":
                return await self._login(request)
            if method in ("GET", "HEAD"):
                return self._login_page()
            return _plain(405, "Method Not Allowed", allow="GET, POST")
        if method not in ("GET", "HEAD"):
            return _plain(405, "Method Not Allowed", allow="GET")  # read-only
        if not self._authorized(request):
            if rest.startswith("/api/"):
                return _json({"error": "log in first (POST /ui/login) or send Authorization: Bearer"}, 401)
            return _redirect(PREFIX + "/login")
        if rest in ("/", "/index.html"):
            body, ctype = self._files["index.html"]
            return web.Response(body=body, content_type=ctype, headers=_HEADERS)
        api = _API.get(rest)
        if api is None:
            return _plain(404, "Not Found")
        if api == "events":
            return await self._events(request)
        return _json(await self._call(_CALLS[api], request.query))

    async def _call(self, fn: Callable[[RunSource, Any], Any], query: Any) -> Any:
        # A live gateway's recorder belongs to its event loop; files and data dirs are read off it.
        if self.source.live:
            return fn(self.source, query)
        return await asyncio.to_thread(fn, self.source, query)

    async def _events(self, request: BaseRequest) -> StreamResponse:
        """Server-sent events: ``run`` when the run table changed, ``turns`` (with the count) when the
        episode ``key`` took a turn. The page fetches what is new."""
        key = request.query.get("key")
        resp = web.StreamResponse(headers={**_HEADERS, "content-type": "text/event-stream",
                                           "x-accel-buffering": "no"})
        await resp.prepare(request)
        last_run: Any = None
        last_turns: int | None = None
        beat = time.monotonic()
        try:
            while not self._closing.is_set():
                version = await self._call(lambda s, _q: s.version(), None)
                if version != last_run:
                    last_run = version
                    await resp.write(b"event: run\ndata: {}\n\n")
                if key:
                    n = await self._call(lambda s, _q: s.turn_count(key), None)
                    if n != last_turns:
                        last_turns = n
                        await resp.write(b"event: turns\ndata: " + orjson.dumps({"turns": n}) + b"\n\n")
                if time.monotonic() - beat > 15:
                    beat = time.monotonic()
                    await resp.write(b": keep-alive\n\n")
                try:
                    await asyncio.wait_for(self._closing.wait(), LIVE_POLL_S)
                except TimeoutError:
                    pass
        except (ConnectionResetError, ConnectionError, RuntimeError):
            pass  # the page went away
        return resp


def _run(s: RunSource, q: Any) -> Any:
    return s.run_page(offset=_int(q, "offset", 0), limit=_int(q, "limit", 50), sort=q.get("sort", "key"),
                      desc=q.get("desc") in ("1", "true"), query=q.get("q", ""),
                      exit_reason=q.get("exit", ""))


_CALLS: dict[str, Callable[[RunSource, Any], Any]] = {
    "run": _run,
    "episode": lambda s, q: s.episode(q.get("key", "")),
    "turns": lambda s, q: s.turns(q.get("key", ""), offset=_int(q, "offset", 0), limit=_int(q, "limit", 50),
                                  line=q.get("line", "all")),
    "tree": lambda s, q: s.tree(q.get("key", ""), side_call=q.get("side") in ("1", "true")),
    "sample": lambda s, q: s.sample(q.get("key", ""), _int(q, "index", 0), offset=_int(q, "offset", 0),
                                    limit=_int(q, "limit", 2000)),
}
_API = {f"/api/{name}": name for name in (*_CALLS, "events")}


async def serve_viewer(viewer: Viewer, host: str = "127.0.0.1", port: int = 0) -> tuple[web.ServerRunner,
                                                                                        int]:
    """Serve ``viewer`` on its own aiohttp server (``ares-gateway view``); returns the runner and the port."""
    runner = web.ServerRunner(web.Server(viewer, access_log=None), handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    sockets = getattr(site._server, "sockets", None) or []
    return runner, int(sockets[0].getsockname()[1]) if sockets else port
