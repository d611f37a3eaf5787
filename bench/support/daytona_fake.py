"""A fake of the Daytona HTTP API at the SDK's HTTP boundary, for tests on machines without Daytona.

The real ``daytona`` SDK is pointed at it (``DAYTONA_API_URL=http://127.0.0.1:PORT/api``).  It serves the
endpoints the SDK calls for our backend: create / get / delete sandbox, the toolbox proxy URL, and the
toolbox's ``process/execute``, ``files/bulk-upload`` and ``files/bulk-download``.  Commands run as real
host processes (``/bin/sh -c``, as the daemon does), files are real host files: a "sandbox" here has the
host's filesystem, so tests give it a temporary workdir.  Only 127.0.0.1 is ever bound.

The exec tunnel's transports, as Daytona's daemon and gateway behave (apps/daemon/pkg/toolbox/process/pty):

* PTY sessions: the WebSocket ``process/pty/create-connect`` (the SDK's one round trip), ``DELETE
  process/pty/{id}`` (kill), ``resize`` and the list.  A real host PTY runs an interactive shell that
  prints noise (a motd, a coloured prompt) first; the fake sends a ``connected`` control message, then
  the PTY's output in binary messages read 32 KiB at a time; it writes every inbound message to the PTY
  and closes a connection whose message is over 64 KiB (the daemon's read limit); it queues at most 256
  messages per client and drops a client whose queue is full ("slow consumer"); the shell's exit closes
  the socket with the exit code as JSON in the close reason.
* SSH access: ``POST/DELETE /api/sandbox/{id}/ssh-access`` (tokens recorded, revocations too) and an
  in-process ``asyncssh`` server on 127.0.0.1 that authenticates a live token given as the user name
  (no password, no key), runs exec requests as host processes with separate stdout/stderr, and refuses
  port forwarding (``tcpip-forward`` and the like) as Daytona's gateway does.  Revoking a token closes
  its connections.

A sandbox created with ``networkBlockAll`` gets its own network namespace (``bwrap --unshare-net``,
joined with ``nsenter``) where every command, PTY and SSH exec of it runs: loopback only.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import WSMsgType, web

API_KEY = "fake-daytona-key"
#: What the daemon's shell prints before any command runs (motd, a coloured prompt, CRLFs).
PTY_NOISE_RC = (
    "printf 'Last login: Thu Dec  3 10:00:00 2025 from 10.0.0.1\\r\\n\\033[1;32mWelcome to "
    "Daytona\\033[0m\\n'\nPS1='\\[\\033[01;34m\\]daytona@sandbox\\[\\033[00m\\]:~$ '\n"
)
PTY_READ = 32 * 1024  # the daemon's read buffer
PTY_QUEUE = 256  # messages queued per client before it is dropped
PTY_READ_LIMIT = 64 * 1024  # the daemon's read limit for one inbound message
EXIT_CONTROL = "X-Daytona-Pty-Exit-Control"


def netns_available() -> bool:
    """Whether ``bwrap --unshare-net`` and ``nsenter`` work here (the fake's closed network)."""
    if shutil.which("bwrap") is None or shutil.which("nsenter") is None:
        return False
    return subprocess.run(["bwrap", "--unshare-net", "--dev-bind", "/", "/", "true"], capture_output=True,
                          check=False).returncode == 0


@dataclass
class PtySession:
    id: str
    proc: subprocess.Popen[bytes]
    master: int
    cols: int
    rows: int
    cwd: str
    envs: dict[str, str]
    created_at: str
    ws: web.WebSocketResponse | None = None
    dropped: str | None = None


@dataclass
class FakeSandbox:
    id: str
    name: str
    request: dict[str, Any]
    state: str = "started"
    created_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()))
    procs: set[asyncio.subprocess.Process] = field(default_factory=set)
    netns: subprocess.Popen[bytes] | None = None  # the holder of its network namespace
    prefix: list[str] = field(default_factory=list)  # runs a command in that namespace
    ptys: dict[str, PtySession] = field(default_factory=dict)


class DaytonaFake:
    def __init__(self) -> None:
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.created: list[dict[str, Any]] = []
        self.deleted: list[str] = []
        self.exec_requests: list[dict[str, Any]] = []
        self.unknown_routes: list[str] = []
        #: PTY sessions ever opened (id -> query of the create-connect call), dropped clients (why).
        self.pty_opened: dict[str, dict[str, str]] = {}
        self.pty_dropped: list[str] = []
        self.pty_killed: list[str] = []
        #: SSH access tokens: token -> sandbox id; revoked tokens; exec commands run over SSH.
        self.ssh_tokens: dict[str, str] = {}
        self.ssh_revoked: list[str] = []
        self.ssh_execs: list[str] = []
        #: Global requests (port forwards) the SSH server refused.
        self.ssh_refused: list[str] = []
        self.ssh_port = 0
        self._ssh_conns: dict[str, set[Any]] = {}
        self._ssh_server: Any = None
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
        app.router.add_get("/toolbox/{sid}/process/pty/create-connect", self.pty_create_connect)
        app.router.add_get("/toolbox/{sid}/process/pty", self.pty_list)
        app.router.add_delete("/toolbox/{sid}/process/pty/{pty}", self.pty_delete)
        app.router.add_post("/toolbox/{sid}/process/pty/{pty}/resize", self.pty_resize)
        app.router.add_post("/api/sandbox/{sid}/ssh-access", self.ssh_access_create)
        app.router.add_delete("/api/sandbox/{sid}/ssh-access", self.ssh_access_revoke)
        app.router.add_route("*", "/{tail:.*}", self.unknown)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        await self._start_ssh()

    def stop(self) -> None:
        if self._loop is None:
            return

        async def shutdown() -> None:
            for sb in self.sandboxes.values():
                self._kill_all(sb)
            if self._ssh_server is not None:
                self._ssh_server.close()
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
            text=json.dumps({"statusCode": 404, "message": f"Sandbox {sid} not found"}),
            content_type="application/json"
        )

    def _dto(self, sb: FakeSandbox) -> dict[str, Any]:
        req = sb.request
        return {
            "id": sb.id, "organizationId": "org-fake", "name": sb.name, "snapshot": req.get("snapshot"),
            "user": req.get("user") or "root", "env": req.get("env") or {}, "labels": req.get("labels") or {},
            "public": False, "networkBlockAll": bool(req.get("networkBlockAll")), "kvm": False,
            "target": "local", "cpu": req.get("cpu") or 1, "gpu": req.get("gpu") or 0,
            "memory": req.get("memory") or 1, "disk": req.get("disk") or 3, "state": sb.state,
            "desiredState": sb.state, "autoStopInterval": req.get("autoStopInterval"),
            "autoDeleteInterval": req.get("autoDeleteInterval"), "createdAt": sb.created_at,
            "updatedAt": sb.created_at, "toolboxProxyUrl": f"http://127.0.0.1:{self.port}/toolbox",
        }

    def _kill_all(self, sb: FakeSandbox) -> None:
        for proc in list(sb.procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for session in list(sb.ptys.values()):
            self._pty_kill(sb, session)
        for token, owner in self.ssh_tokens.items():
            if owner == sb.id:
                self._ssh_close(token)
        if sb.netns is not None:
            sb.netns.kill()
            sb.netns.wait()
            sb.netns = None

    def _make_netns(self, sb: FakeSandbox) -> None:
        """A network namespace (loopback only) for the sandbox: a bwrap'd ``sleep`` holds it, and
        every command of the sandbox joins it with nsenter."""
        holder = subprocess.Popen(["bwrap", "--unshare-net", "--die-with-parent", "--dev-bind", "/", "/",
                                   "sleep", "infinity"], stdin=subprocess.DEVNULL, start_new_session=True)
        inner = None
        for _ in range(200):
            with contextlib.suppress(OSError):
                kids = open(f"/proc/{holder.pid}/task/{holder.pid}/children").read().split()
                if kids and os.readlink(f"/proc/{kids[0]}/ns/net") != os.readlink("/proc/self/ns/net"):
                    inner = kids[0]
                    break
            time.sleep(0.01)
        if inner is None:
            holder.kill()
            raise RuntimeError("the fake's network namespace did not come up")
        sb.netns = holder
        sb.prefix = ["nsenter", "-t", inner, "-n"]
        if os.readlink(f"/proc/{inner}/ns/user") != os.readlink("/proc/self/ns/user"):
            sb.prefix += ["-U", "--preserve-credentials"]
        sb.prefix.append("--")

    # -- control plane -------------------------------------------------------------------------------
    async def create(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.created.append(body)
        name = body.get("name") or str(uuid.uuid4())
        if any(sb.name == name and sb.state != "destroyed" for sb in self.sandboxes.values()):
            return web.json_response({"statusCode": 409, "message": f"Sandbox {name} already exists"},
                                     status=409)
        sb = FakeSandbox(id=str(uuid.uuid4()), name=name, request=body)
        if body.get("networkBlockAll") and netns_available():
            self._make_netns(sb)
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
            *sb.prefix, "/bin/sh", "-c", body["command"], cwd=body.get("cwd") or "/", env=env,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True,
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

    # -- toolbox PTY sessions (the daemon's apps/daemon/pkg/toolbox/process/pty) ---------------------
    def _pty_info(self, session: PtySession) -> dict[str, Any]:
        return {"id": session.id, "cwd": session.cwd, "envs": session.envs, "cols": session.cols,
                "rows": session.rows, "createdAt": session.created_at, "active": session.proc.poll() is None,
                "lazyStart": False}

    def _pty_kill(self, sb: FakeSandbox, session: PtySession) -> None:
        """SIGKILL the shell's whole process tree, as the daemon does (children first)."""
        def tree(pid: int) -> list[int]:
            kids: list[int] = []
            with contextlib.suppress(OSError):
                for task in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{task}/children") as fh:
                        kids += [int(k) for k in fh.read().split()]
            return [p for k in kids for p in tree(k)] + kids

        for pid in [*tree(session.proc.pid), session.proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        sb.ptys.pop(session.id, None)

    async def pty_list(self, request: web.Request) -> web.Response:
        sb = self._find(request.match_info["sid"])
        return web.json_response({"sessions": [self._pty_info(p) for p in sb.ptys.values()]})

    async def pty_delete(self, request: web.Request) -> web.Response:
        sb = self._find(request.match_info["sid"])
        session = sb.ptys.get(request.match_info["pty"])
        if session is None:
            return web.json_response({"error": "PTY session not found"}, status=404)
        self.pty_killed.append(session.id)
        self._pty_kill(sb, session)
        return web.json_response({"message": "PTY session deleted"})

    async def pty_resize(self, request: web.Request) -> web.Response:
        import fcntl
        import struct
        import termios

        sb = self._find(request.match_info["sid"])
        session = sb.ptys.get(request.match_info["pty"])
        if session is None or session.proc.poll() is not None:
            return web.json_response({"error": "PTY session is not active"}, status=410)
        body = await request.json()
        cols, rows = int(body.get("cols", 0)), int(body.get("rows", 0))
        if not (0 < cols <= 1000 and 0 < rows <= 1000):
            return web.json_response({"error": "cols and rows must be in 1..1000"}, status=400)
        fcntl.ioctl(session.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        session.cols, session.rows = cols, rows
        return web.json_response(self._pty_info(session))

    async def pty_create_connect(self, request: web.Request) -> web.StreamResponse:
        import fcntl
        import struct
        import termios

        sb = self._find(request.match_info["sid"])
        query = dict(request.query)
        pid = query.get("id") or ""
        if not pid:
            return web.json_response({"error": "session ID is required"}, status=400)
        if pid in sb.ptys:
            return web.json_response({"error": f"PTY session with ID '{pid}' already exists"}, status=409)
        cols, rows = int(query.get("cols") or 80), int(query.get("rows") or 24)
        if cols > 1000 or rows > 1000:
            return web.json_response({"error": "invalid value for cols/rows - must be less than 1000"},
                                     status=400)
        envs: dict[str, str] = {}
        for proto in request.headers.get("Sec-WebSocket-Protocol", "").split(","):
            proto = proto.strip()
            if proto.startswith("X-Daytona-Pty-Envs~"):
                raw = proto.split("~", 1)[1]
                envs = json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
        envs.setdefault("TERM", "xterm-256color")
        # gorilla's SetReadLimit(n) refuses messages over n bytes; aiohttp's max_msg_size refuses n itself.
        ws = web.WebSocketResponse(protocols=(EXIT_CONTROL,), max_msg_size=PTY_READ_LIMIT + 1)
        await ws.prepare(request)
        self.pty_opened[pid] = query
        rc = tempfile.NamedTemporaryFile("w", prefix="fake-pty-rc-", suffix=".sh", delete=False)
        with rc:
            rc.write(PTY_NOISE_RC)
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
               **(sb.request.get("env") or {}), **envs}
        cwd = query.get("cwd") or "/"
        argv = [*sb.prefix, "bash", "--noprofile", "--rcfile", rc.name, "-i"]
        proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env,  # noqa: ASYNC220
                                start_new_session=True)  # a fork-exec that returns at once, as the daemon's
        os.close(slave)
        os.set_blocking(master, False)
        session = PtySession(pid, proc, master, cols, rows, cwd, envs,
                             time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()), ws)
        sb.ptys[pid] = session
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(PTY_QUEUE)

        closing: list[asyncio.Future[Any]] = []

        def drop(why: str) -> None:
            if session.dropped is None:
                session.dropped = why
                self.pty_dropped.append(f"{pid}: {why}")
                closing.append(asyncio.ensure_future(ws.close(code=1008, message=why.encode())))

        def readable() -> None:
            try:
                data = os.read(master, PTY_READ)
            except BlockingIOError:
                return
            except OSError:  # EIO: the shell and everything on its PTY are gone
                data = b""
            if not data:
                loop.remove_reader(master)
                with contextlib.suppress(asyncio.QueueFull):
                    queue.put_nowait(None)
                return
            if session.dropped is None:
                try:
                    queue.put_nowait(data)
                except asyncio.QueueFull:  # the daemon does not wait for a slow client: it drops it
                    drop("slow consumer")

        async def pump_out() -> None:
            await ws.send_str(json.dumps({"type": "control", "status": "connected"}))
            while (data := await queue.get()) is not None:
                await ws.send_bytes(data)

        async def write_all(data: bytes) -> None:
            view = memoryview(data)
            while view:
                try:
                    view = view[os.write(master, view):]
                except BlockingIOError:
                    ready: asyncio.Future[None] = loop.create_future()

                    def wake(fut: asyncio.Future[None] = ready) -> None:
                        if not fut.done():
                            fut.set_result(None)

                    loop.add_writer(master, wake)
                    try:
                        await ready
                    finally:
                        loop.remove_writer(master)

        async def pump_in() -> None:
            async for msg in ws:
                if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                    await write_all(msg.data.encode() if isinstance(msg.data, str) else msg.data)
                else:
                    if msg.type == WSMsgType.ERROR:
                        self.pty_dropped.append(f"{pid}: {ws.exception()}")
                    break

        loop.add_reader(master, readable)
        out, inp = asyncio.ensure_future(pump_out()), asyncio.ensure_future(pump_in())
        exited = asyncio.ensure_future(asyncio.to_thread(proc.wait))
        try:
            await asyncio.wait({out, inp, exited}, return_when=asyncio.FIRST_COMPLETED)
            if exited.done() and not ws.closed:
                code = exited.result()
                code = 128 - code if code < 0 else code
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(out, 5)  # what the PTY printed last goes out first
                reason = json.dumps({"exitCode": code, **({"exitReason": "SIGKILL"} if code == 137 else {})})
                await ws.close(code=1000 if code == 0 else 1011, message=reason.encode())
        finally:
            for task in (out, inp):
                task.cancel()
            if not ws.closed:
                await ws.close()
            # A client that goes away leaves the session running, as the daemon does: only DELETE or
            # the shell's exit ends it.  Its PTY is closed once the shell is gone.
            if exited.done():
                loop.remove_reader(master)
                os.close(master)
                sb.ptys.pop(pid, None)
            else:
                def release(_: object) -> None:
                    loop.remove_reader(master)
                    os.close(master)

                exited.add_done_callback(release)
            os.unlink(rc.name)
        return ws

    # -- SSH access and the gateway ----------------------------------------------------------------
    async def _start_ssh(self) -> None:
        import asyncssh

        key = asyncssh.generate_private_key("ssh-ed25519")
        fake = self

        class Gateway(asyncssh.SSHServer):
            def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
                self.conn: asyncssh.SSHServerConnection = conn
                self.token: str | None = None

            def begin_auth(self, username: str) -> bool:
                owner = fake.ssh_tokens.get(username)
                if (owner is None or username in fake.ssh_revoked
                    or fake.sandboxes[owner].state == "destroyed"):
                    return True  # auth "required", and no method accepted: permission denied
                self.token = username
                fake._ssh_conns.setdefault(username, set()).add(self.conn)
                return False  # the token is the credential

            def connection_lost(self, exc: Exception | None) -> None:
                if self.token is not None:
                    fake._ssh_conns.get(self.token, set()).discard(self.conn)

            def server_requested(self, listen_host: str, listen_port: int) -> bool:
                fake.ssh_refused.append(f"tcpip-forward {listen_host}:{listen_port}")
                return False

            def unix_server_requested(self, listen_path: str) -> bool:
                fake.ssh_refused.append(f"streamlocal-forward {listen_path}")
                return False

            def connection_requested(self, dest_host: str, dest_port: int, orig_host: str,
                                     orig_port: int) -> bool:
                fake.ssh_refused.append(f"direct-tcpip {dest_host}:{dest_port}")
                return False

        self._ssh_server = await asyncssh.create_server(
            Gateway, "127.0.0.1", 0, server_host_keys=[key], process_factory=self._ssh_exec, encoding=None,
            allow_scp=False, agent_forwarding=False, x11_forwarding=False, line_editor=False,
        )
        self.ssh_port = self._ssh_server.sockets[0].getsockname()[1]

    def _ssh_close(self, token: str) -> None:
        for conn in list(self._ssh_conns.pop(token, set())):
            conn.close()

    async def _ssh_exec(self, process: Any) -> None:
        token = process.get_extra_info("username")
        sb = self.sandboxes[self.ssh_tokens[token]]
        command = process.command
        if not command:
            process.stderr.write(b"only exec requests here\n")
            process.exit(1)
            return
        self.ssh_execs.append(command)
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
               **(sb.request.get("env") or {})}
        proc = await asyncio.create_subprocess_exec(
            *sb.prefix, "/bin/sh", "-c", command, env=env, cwd="/", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
        )
        sb.procs.add(proc)

        async def up() -> None:
            assert proc.stdin is not None
            with contextlib.suppress(Exception):
                while data := await process.stdin.read(65536):
                    proc.stdin.write(data)
                    await proc.stdin.drain()
            with contextlib.suppress(Exception):
                proc.stdin.close()

        async def down(src: asyncio.StreamReader | None, dst: Any) -> None:
            assert src is not None
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()

        pumps = [asyncio.ensure_future(up()), asyncio.ensure_future(down(proc.stdout, process.stdout)),
                 asyncio.ensure_future(down(proc.stderr, process.stderr))]
        try:
            await asyncio.gather(*pumps[1:])
            code = await proc.wait()
            process.exit(code if code >= 0 else 128 - code)
        except Exception:  # the client went away: the channel's command goes with it
            pass
        finally:
            for pump in pumps:
                pump.cancel()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            sb.procs.discard(proc)

    async def ssh_access_create(self, request: web.Request) -> web.Response:
        sb = self._find(request.match_info["sid"])
        minutes = int(request.query.get("expiresInMinutes") or 60)
        token = uuid.uuid4().hex
        self.ssh_tokens[token] = sb.id
        now = datetime.datetime.now(datetime.UTC)
        stamp = now.strftime("%Y-%m-%dT%H:%M:%S.000Z")
        return web.json_response({
            "id": str(uuid.uuid4()), "sandboxId": sb.id, "token": token, "createdAt": stamp,
            "updatedAt": stamp,
            "expiresAt": (now + datetime.timedelta(minutes=minutes)).strftime("%Y-%m-%dT%H:%M:%S.000Z"),
            "sshCommand": f"ssh -p {self.ssh_port} {token}@127.0.0.1",
        })

    async def ssh_access_revoke(self, request: web.Request) -> web.Response:
        sb = self._find(request.match_info["sid"])
        token = request.query.get("token")
        tokens = [token] if token else [t for t, owner in self.ssh_tokens.items() if owner == sb.id]
        for t in tokens:
            if self.ssh_tokens.get(t) == sb.id and t not in self.ssh_revoked:
                self.ssh_revoked.append(t)
                self._ssh_close(t)
        return web.json_response(self._dto(sb))


def main() -> None:
    """The fake as its own process (``python3 -m bench.support.daytona_fake``), as the real daemon is:
    prints ``{"api_url": ..., "ssh_port": ...}`` and serves until its stdin ends."""
    fake = DaytonaFake().start()
    print(json.dumps({"api_url": fake.api_url, "ssh_port": fake.ssh_port}), flush=True)
    sys.stdin.read()
    fake.stop()


if __name__ == "__main__":
    main()
