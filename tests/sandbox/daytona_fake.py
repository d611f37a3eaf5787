"""A fake of the Daytona HTTP API at the SDK's HTTP boundary, for tests on machines without Daytona.

The real ``daytona`` SDK is pointed at it (``DAYTONA_API_URL=http://127.0.0.1:PORT/api``).  It serves the
endpoints the SDK calls for our backend: create / get / delete sandbox, the toolbox proxy URL, and the
toolbox's ``process/execute``, ``files/bulk-upload`` and ``files/bulk-download``.  Commands run as real
host processes (``/bin/sh -c``, as the daemon does), files are real host files: a "sandbox" here has the
host's filesystem, so tests give it a temporary workdir.  Only 127.0.0.1 is ever bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

API_KEY = "fake-daytona-key"


@dataclass
class FakeSandbox:
    id: str
    name: str
    request: dict[str, Any]
    state: str = "started"
    created_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()))
    procs: set[asyncio.subprocess.Process] = field(default_factory=set)


class DaytonaFake:
    def __init__(self) -> None:
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.created: list[dict[str, Any]] = []
        self.deleted: list[str] = []
        self.exec_requests: list[dict[str, Any]] = []
        self.unknown_routes: list[str] = []
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    # -- lifecycle of the fake itself --------------------------------------------------------------
    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def start(self) -> DaytonaFake:
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(self._serve())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="daytona-fake", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the Daytona fake did not start")
        return self

    async def _serve(self) -> None:
        app = web.Application(client_max_size=1024**3, middlewares=[self._auth])
        app.router.add_post("/api/sandbox", self.create)
        app.router.add_get("/api/sandbox", self.list)
        app.router.add_get("/api/sandbox/{sid}", self.get)
        app.router.add_delete("/api/sandbox/{sid}", self.delete)
        app.router.add_get("/api/sandbox/{sid}/toolbox-proxy-url", self.proxy_url)
        app.router.add_post("/toolbox/{sid}/process/execute", self.execute)
        app.router.add_post("/toolbox/{sid}/files/bulk-upload", self.bulk_upload)
        app.router.add_post("/toolbox/{sid}/files/bulk-download", self.bulk_download)
        app.router.add_route("*", "/{tail:.*}", self.unknown)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def stop(self) -> None:
        if self._loop is None:
            return

        async def shutdown() -> None:
            for sb in self.sandboxes.values():
                self._kill_all(sb)
            if self._runner is not None:
                await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)

    def live(self) -> list[FakeSandbox]:
        return [sb for sb in self.sandboxes.values() if sb.state != "destroyed"]

    # -- helpers -----------------------------------------------------------------------------------
    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {API_KEY}":
            return web.json_response({"statusCode": 401, "message": "Unauthorized"}, status=401)
        return await handler(request)

    def _find(self, sid: str) -> FakeSandbox:
        for sb in self.sandboxes.values():
            if sid in (sb.id, sb.name) and sb.state != "destroyed":
                return sb
        raise web.HTTPNotFound(
            text=json.dumps({"statusCode": 404, "message": f"Sandbox {sid} not found"}), content_type="application/json"
        )

    def _dto(self, sb: FakeSandbox) -> dict[str, Any]:
        req = sb.request
        return {
            "id": sb.id, "organizationId": "org-fake", "name": sb.name, "snapshot": req.get("snapshot"),
            "user": req.get("user") or "root", "env": req.get("env") or {}, "labels": req.get("labels") or {},
            "public": False, "networkBlockAll": bool(req.get("networkBlockAll")), "kvm": False, "target": "local",
            "cpu": req.get("cpu") or 1, "gpu": req.get("gpu") or 0, "memory": req.get("memory") or 1,
            "disk": req.get("disk") or 3, "state": sb.state, "desiredState": sb.state,
            "autoStopInterval": req.get("autoStopInterval"), "autoDeleteInterval": req.get("autoDeleteInterval"),
            "createdAt": sb.created_at, "updatedAt": sb.created_at,
            "toolboxProxyUrl": f"http://127.0.0.1:{self.port}/toolbox",
        }

    def _kill_all(self, sb: FakeSandbox) -> None:
        for proc in list(sb.procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

    # -- control plane -------------------------------------------------------------------------------
    async def create(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.created.append(body)
        name = body.get("name") or str(uuid.uuid4())
        if any(sb.name == name and sb.state != "destroyed" for sb in self.sandboxes.values()):
            return web.json_response({"statusCode": 409, "message": f"Sandbox {name} already exists"}, status=409)
        sb = FakeSandbox(id=str(uuid.uuid4()), name=name, request=body)
        self.sandboxes[sb.id] = sb
        return web.json_response(self._dto(sb))

    async def list(self, request: web.Request) -> web.Response:
        return web.json_response({"items": [self._dto(sb) for sb in self.live()], "nextCursor": None})

    async def get(self, request: web.Request) -> web.Response:
        return web.json_response(self._dto(self._find(request.match_info["sid"])))

    async def delete(self, request: web.Request) -> web.Response:
        sb = self._find(request.match_info["sid"])
        self._kill_all(sb)
        sb.state = "destroyed"
        self.deleted.append(sb.id)
        return web.json_response(self._dto(sb))

    async def proxy_url(self, request: web.Request) -> web.Response:
        self._find(request.match_info["sid"])
        return web.json_response({"url": f"http://127.0.0.1:{self.port}/toolbox"})

    async def unknown(self, request: web.Request) -> web.Response:
        self.unknown_routes.append(f"{request.method} {request.path}")
        return web.json_response({"statusCode": 404, "message": "not found"}, status=404)

    # -- toolbox -------------------------------------------------------------------------------------
    async def execute(self, request: web.Request) -> web.Response:
        sb = self._find(request.match_info["sid"])
        body = await request.json()
        self.exec_requests.append(body)
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"}
        env.update(sb.request.get("env") or {})
        env.update(body.get("envs") or {})
        timeout = body.get("timeout") or 10  # the daemon's documented default
        proc = await asyncio.create_subprocess_exec(
            "/bin/sh", "-c", body["command"], cwd=body.get("cwd") or "/", env=env,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        sb.procs.add(proc)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            return web.json_response({"statusCode": 408, "message": "command execution timeout"}, status=408)
        finally:
            sb.procs.discard(proc)
        return web.json_response({"exitCode": proc.returncode, "result": out.decode("utf-8", "replace")})

    async def bulk_upload(self, request: web.Request) -> web.Response:
        self._find(request.match_info["sid"])
        reader = await request.multipart()
        paths: dict[str, str] = {}
        while (part := await reader.next()) is not None:
            name = part.name or ""  # type: ignore[union-attr]
            if name.endswith(".path"):
                paths[name[: -len(".path")]] = (await part.read()).decode()  # type: ignore[union-attr]
            elif name.endswith(".file"):
                key = name[: -len(".file")]
                dest = paths.get(key) or part.filename  # type: ignore[union-attr]
                if not dest:
                    return web.json_response({"errors": [f"no path for {key}"]}, status=400)
                os.makedirs(os.path.dirname(dest) or "/", exist_ok=True)
                with open(dest, "wb") as fh:  # noqa: ASYNC230 - a test double, local files
                    while chunk := await part.read_chunk(1024 * 1024):  # type: ignore[union-attr]
                        fh.write(chunk)
        return web.Response(status=200)

    async def bulk_download(self, request: web.Request) -> web.StreamResponse:
        self._find(request.match_info["sid"])
        body = await request.json()
        boundary = uuid.uuid4().hex
        resp = web.StreamResponse(headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
        await resp.prepare(request)
        for path in body.get("paths") or []:
            if os.path.isfile(path):  # noqa: ASYNC240
                head = (
                    f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{path}"\r\n'
                    "Content-Type: application/octet-stream\r\n\r\n"
                )
                await resp.write(head.encode())
                with open(path, "rb") as fh:  # noqa: ASYNC230
                    while chunk := fh.read(1024 * 1024):
                        await resp.write(chunk)
                await resp.write(b"\r\n")
            else:
                head = (
                    f'--{boundary}\r\nContent-Disposition: form-data; name="error"; filename="{path}"\r\n'
                    "Content-Type: application/json\r\n\r\n"
                )
                err = json.dumps({"message": f"file not found: {path}", "statusCode": 404})
                await resp.write(head.encode() + err.encode() + b"\r\n")
        await resp.write(f"--{boundary}--\r\n".encode())
        await resp.write_eof()
        return resp
