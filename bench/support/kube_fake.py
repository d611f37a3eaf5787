"""A stand-in for the Kubernetes API server, at the wire boundary the real client talks to.

``kubernetes_asyncio`` is pointed at it through a kubeconfig (:meth:`KubeFake.write_kubeconfig`: server
``http://127.0.0.1:PORT``, a bearer token).  It serves what :class:`sandbox.kubernetes.KubernetesSandbox`
calls: namespaced pods (create, read, delete, list by label selector), networking.k8s.io/v1
NetworkPolicies (create, delete, list), and ``pods/{name}/exec`` as a WebSocket upgrade speaking the
remote-command subprotocols: ``v5.channel.k8s.io`` and ``v4.channel.k8s.io`` (whichever of
:attr:`KubeFake.protocols` the client lists first), each message one channel byte then data (0 stdin,
1 stdout, 2 stderr, 3 the exit status as a ``metav1.Status`` JSON, sent once the command ended, then the
socket closes; in v5, ``[255, 0]`` from the client ends the command's stdin).  An exec connection that
receives nothing for :attr:`KubeFake.idle_timeout` seconds is cut, as the apiserver's stream deadline
(reset by every message from the client) does.

A "pod" is a ``bwrap`` sandbox: its own network namespace (loopback only, so no network at all), PID,
IPC and UTS namespaces, the pod's command as PID 1, and a host temporary directory as its root
filesystem with the host's system directories (``/usr``, ``/bin``, ``/lib*``, ``/sbin``, ``/etc``) bound
read-only.  An exec runs its command in those namespaces (``nsenter``), as a host process.  Needs root,
``bwrap`` and ``nsenter`` (:func:`unavailable` says what is missing).  Only 127.0.0.1 is ever bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import WSMsgType, web

TOKEN = "kube-fake-token-3b9f0c2e7d51a846"
PROTOCOLS = ("v5.channel.k8s.io", "v4.channel.k8s.io")
_SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc")
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def unavailable() -> str | None:
    """Why pods cannot run here (None when they can)."""
    if os.geteuid() != 0:
        return "the Kubernetes fake runs pods with bwrap and nsenter, which need root"
    for tool in ("bwrap", "nsenter"):
        if shutil.which(tool) is None:
            return f"the Kubernetes fake needs {tool}"
    return None


def _system_binds() -> list[str]:
    """bwrap arguments giving a pod the host's system directories, read-only (symlinks as symlinks)."""
    argv: list[str] = []
    for entry in _SYSTEM_DIRS:
        host = f"/{entry}"
        if os.path.islink(host):
            argv += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            argv += ["--ro-bind", host, host]
    return argv


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _status(code: int, reason: str, message: str) -> web.Response:
    return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                              "message": message, "reason": reason, "code": code}, status=code)


def _bool(value: str | None) -> bool:
    """A query parameter as the apiserver reads it (Go's strconv.ParseBool; the client sends "True")."""
    return value in ("1", "t", "T", "TRUE", "true", "True")


def _matches(labels: dict[str, str], selector: str) -> bool:
    """``k=v``, ``k==v``, ``k!=v``, ``k`` and ``!k`` requirements, comma-separated."""
    for req in filter(None, (r.strip() for r in selector.split(","))):
        if "!=" in req:
            k, v = req.split("!=", 1)
            if labels.get(k) == v:
                return False
        elif "=" in req:
            k, v = req.replace("==", "=").split("=", 1)
            if labels.get(k) != v:
                return False
        elif req.startswith("!"):
            if req[1:] in labels:
                return False
        elif req not in labels:
            return False
    return True


@dataclass
class FakePod:
    namespace: str
    name: str
    body: dict[str, Any]
    root: Path
    pid: int = 0  # the host pid of the pod's PID 1
    keeper: asyncio.subprocess.Process | None = None
    failure: str | None = None  # a waiting reason (ErrImagePull) when the pod cannot start
    #: The open exec connections: their transport and command.
    execs: dict[web.WebSocketResponse,
                tuple[asyncio.BaseTransport | None, list[str]]] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        container = self.body["spec"]["containers"][0]
        env = {"PATH": _PATH, "HOME": "/root", "HOSTNAME": self.name}
        env.update({e["name"]: e.get("value", "") for e in container.get("env") or []})
        return env


class KubeFake:
    """The fake API server (see the module's docstring); :meth:`start` runs it on a thread of its own."""

    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], FakePod] = {}
        self.policies: dict[tuple[str, str], dict[str, Any]] = {}
        self.created_pods: list[dict[str, Any]] = []
        self.deleted_pods: list[str] = []
        self.deleted_policies: list[str] = []
        #: (pod, argv, negotiated subprotocol) of every exec.
        self.execs: list[tuple[str, list[str], str]] = []
        self.requests: list[str] = []
        self.unknown_routes: list[str] = []
        #: What the exec endpoint offers (set ("v4.channel.k8s.io",) to test the fallback).
        self.protocols: tuple[str, ...] = PROTOCOLS
        #: Cut an exec connection after this many seconds without a message from the client.
        self.idle_timeout: float | None = None
        self.idle_cuts = 0
        self.port = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._reapers: set[asyncio.Future[int]] = set()

    # -- the fake itself -----------------------------------------------------------------------------
    @property
    def server(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_kubeconfig(self, path: str | os.PathLike[str], *, namespace: str = "ares-test",
                         token: str = TOKEN) -> str:
        """A kubeconfig for this fake (JSON is YAML): its server, a bearer token, a namespace."""
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "fake", "preferences": {},
            "clusters": [{"name": "fake", "cluster": {"server": self.server}}],
            "users": [{"name": "fake", "user": {"token": token}}],
            "contexts": [
                {"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": namespace}}],
        }
        Path(path).write_text(json.dumps(config))
        return str(path)

    def start(self) -> KubeFake:
        ready = threading.Event()

        def run() -> None:
            self.loop = asyncio.new_event_loop()
            self.loop.run_until_complete(self._serve())
            ready.set()
            self.loop.run_forever()

        self._thread = threading.Thread(target=run, name="kube-fake", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the Kubernetes fake did not start")
        return self

    def call(self, coro: Any, timeout: float = 30) -> Any:
        """Run a coroutine on the fake's loop from another thread."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _serve(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._auth])
        pods, policies = ("/api/v1/namespaces/{ns}/pods",
                          "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies")
        app.router.add_post(pods, self.create_pod)
        app.router.add_get(pods, self.list_pods)
        app.router.add_get(pods + "/{name}", self.read_pod)
        app.router.add_delete(pods + "/{name}", self.delete_pod)
        app.router.add_route("GET", pods + "/{name}/exec", self.exec)
        app.router.add_route("POST", pods + "/{name}/exec", self.exec)
        app.router.add_post(policies, self.create_policy)
        app.router.add_get(policies, self.list_policies)
        app.router.add_delete(policies + "/{name}", self.delete_policy)
        app.router.add_route("*", "/{tail:.*}", self.unknown)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def stop(self) -> None:
        if self.loop is None:
            return

        async def shutdown() -> None:
            for pod in list(self.pods.values()):
                await self._remove(pod)
            if self._runner is not None:
                await self._runner.cleanup()

        self.call(shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        if self._thread is not None:
            self._thread.join(10)

    def drop_execs(self, pod_name: str | None = None, *, running: str = "") -> int:
        """Cut the open exec connections (of one pod, whose command contains ``running``) without a
        close frame: a dropped transport.  Returns how many."""
        async def drop() -> int:
            n = 0
            for pod in list(self.pods.values()):
                if pod_name is None or pod.name == pod_name:
                    for transport, argv in list(pod.execs.values()):
                        if transport is not None and running in " ".join(argv):
                            transport.abort()  # type: ignore[attr-defined]
                            n += 1
            return n

        return int(self.call(drop()))

    def pod(self, name: str) -> FakePod | None:
        return next((p for p in self.pods.values() if p.name == name), None)

    # -- helpers ---------------------------------------------------------------------------------------
    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.requests.append(f"{request.method} {request.path}")
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return _status(401, "Unauthorized", "Unauthorized")
        return await handler(request)  # type: ignore[no-any-return]

    def _pod_json(self, pod: FakePod) -> dict[str, Any]:
        body = json.loads(json.dumps(pod.body))
        image = body["spec"]["containers"][0].get("image", "")
        state: dict[str, Any]
        if pod.failure:
            phase, state = "Pending", {"waiting": {"reason": pod.failure, "message": f"cannot pull {image}"}}
        elif pod.pid and pod.keeper is not None and pod.keeper.returncode is None:
            phase, state = "Running", {"running": {"startedAt": _now()}}
        elif pod.keeper is not None and pod.keeper.returncode is not None:
            phase, state = "Failed", {"terminated": {"exitCode": pod.keeper.returncode, "reason": "Error"}}
        else:
            phase, state = "Pending", {"waiting": {"reason": "ContainerCreating"}}
        body["status"] = {"phase": phase, "containerStatuses": [{
            "name": "sandbox", "image": image, "imageID": "", "ready": phase == "Running", "restartCount": 0,
            "state": state}]}
        return dict(body)

    async def _start_keeper(self, pod: FakePod) -> None:
        container = pod.body["spec"]["containers"][0]
        command = [*(container.get("command") or ["sleep", "infinity"]), *(container.get("args") or [])]
        os.chmod(pod.root, 0o755)  # mkdtemp's 0700 would keep every user but root out of "/"
        (pod.root / "tmp").mkdir(mode=0o1777)
        os.chmod(pod.root / "tmp", 0o1777)
        argv = ["bwrap", "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--hostname",
                pod.name, "--as-pid-1", "--die-with-parent", "--bind", str(pod.root), "/"]
        argv += _system_binds()
        r, w = os.pipe()
        argv += ["--proc", "/proc", "--dev", "/dev", "--info-fd", str(w), "--", *command]
        try:
            pod.keeper = await asyncio.create_subprocess_exec(
                *argv, pass_fds=(w,), env=pod.env, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, start_new_session=True)
        finally:
            os.close(w)

        def info() -> dict[str, Any]:
            data = b""
            with os.fdopen(r, "rb") as fh:
                while chunk := fh.read(4096):
                    data += chunk
                    with contextlib.suppress(ValueError):
                        return dict(json.loads(data))
            return dict(json.loads(data or b"{}"))

        pid = int((await asyncio.wait_for(asyncio.to_thread(info), 10)).get("child-pid") or 0)
        # bwrap tells the pid before the child has made its mounts: running once it runs the command.
        want = "\0".join(command).encode() + b"\0"
        for _ in range(400):
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes() == want:  # noqa: ASYNC240 - procfs
                    pod.pid = pid
                    return
            except OSError:
                pass
            await asyncio.sleep(0.025)
        raise RuntimeError(f"the fake pod {pod.name} did not start its command")

    async def _remove(self, pod: FakePod) -> None:
        for transport, _argv in list(pod.execs.values()):
            if transport is not None:
                transport.abort()  # type: ignore[attr-defined]
        if pod.pid:  # PID 1 gone: the kernel kills the rest of the pod's PID namespace
            with contextlib.suppress(ProcessLookupError):
                os.kill(pod.pid, signal.SIGKILL)
        if pod.keeper is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pod.keeper.pid, signal.SIGKILL)
            await pod.keeper.wait()
        await asyncio.to_thread(shutil.rmtree, pod.root, True)
        self.pods.pop((pod.namespace, pod.name), None)

    # -- pods -----------------------------------------------------------------------------------------
    async def create_pod(self, request: web.Request) -> web.Response:
        ns = request.match_info["ns"]
        body = await request.json()
        if body.get("kind", "Pod") != "Pod" or not (body.get("metadata") or {}).get("name"):
            return _status(400, "BadRequest", "a Pod with metadata.name is required")
        name = body["metadata"]["name"]
        if (ns, name) in self.pods:
            return _status(409, "AlreadyExists", f'pods "{name}" already exists')
        meta = body["metadata"]
        meta.update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=_now(), resourceVersion="1")
        self.created_pods.append(body)
        pod = FakePod(ns, name, body, Path(tempfile.mkdtemp(prefix=f"kube-fake-{name}-")))
        self.pods[(ns, name)] = pod
        if "missing" in body["spec"]["containers"][0].get("image", ""):
            pod.failure = "ErrImagePull"
        else:
            await self._start_keeper(pod)
        return web.json_response(self._pod_json(pod), status=201)

    def _find(self, request: web.Request) -> FakePod:
        key = (request.match_info["ns"], request.match_info["name"])
        if key not in self.pods:
            raise web.HTTPNotFound(text=json.dumps({
                "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404,
                "message": f'pods "{key[1]}" not found'}), content_type="application/json")
        return self.pods[key]

    async def read_pod(self, request: web.Request) -> web.Response:
        return web.json_response(self._pod_json(self._find(request)))

    async def list_pods(self, request: web.Request) -> web.Response:
        ns, selector = request.match_info["ns"], request.query.get("labelSelector", "")
        items = [self._pod_json(p) for (n, _), p in self.pods.items()
                 if n == ns and _matches(p.body["metadata"].get("labels") or {}, selector)]
        return web.json_response({"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items})

    async def delete_pod(self, request: web.Request) -> web.Response:
        pod = self._find(request)
        body = self._pod_json(pod)
        body["metadata"]["deletionTimestamp"] = _now()
        await self._remove(pod)
        self.deleted_pods.append(pod.name)
        return web.json_response(body)

    # -- network policies -------------------------------------------------------------------------------
    async def create_policy(self, request: web.Request) -> web.Response:
        ns = request.match_info["ns"]
        body = await request.json()
        name = (body.get("metadata") or {}).get("name")
        if body.get("kind", "NetworkPolicy") != "NetworkPolicy" or not name:
            return _status(400, "BadRequest", "a NetworkPolicy with metadata.name is required")
        if (ns, name) in self.policies:
            return _status(409, "AlreadyExists", f'networkpolicies.networking.k8s.io "{name}" already exists')
        body["metadata"].update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
        self.policies[(ns, name)] = body
        return web.json_response(body, status=201)

    async def list_policies(self, request: web.Request) -> web.Response:
        ns, selector = request.match_info["ns"], request.query.get("labelSelector", "")
        items = [p for (n, _), p in self.policies.items()
                 if n == ns and _matches(p["metadata"].get("labels") or {}, selector)]
        return web.json_response({"kind": "NetworkPolicyList", "apiVersion": "networking.k8s.io/v1",
                                  "metadata": {}, "items": items})

    async def delete_policy(self, request: web.Request) -> web.Response:
        key = (request.match_info["ns"], request.match_info["name"])
        if self.policies.pop(key, None) is None:
            return _status(404, "NotFound", f'networkpolicies.networking.k8s.io "{key[1]}" not found')
        self.deleted_policies.append(key[1])
        return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                  "details": {"name": key[1], "group": "networking.k8s.io",
                                              "kind": "networkpolicies"}})

    async def unknown(self, request: web.Request) -> web.Response:
        self.unknown_routes.append(f"{request.method} {request.path}")
        return _status(404, "NotFound", "the server could not find the requested resource")

    # -- exec -------------------------------------------------------------------------------------------
    async def exec(self, request: web.Request) -> web.StreamResponse:
        pod = self._find(request)
        command = request.query.getall("command", [])
        stdin = _bool(request.query.get("stdin"))
        if not command:
            return _status(400, "BadRequest", "you must specify at least 1 command")
        if _bool(request.query.get("tty")):
            return _status(400, "BadRequest", "the fake has no TTY")
        if not pod.pid or pod.keeper is None or pod.keeper.returncode is not None:
            return _status(400, "BadRequest", f"pod {pod.name} is not running")
        ws = web.WebSocketResponse(protocols=self.protocols, max_msg_size=0, autoping=True)
        if not ws.can_prepare(request).ok:
            return _status(400, "BadRequest", "Upgrade request required")
        await ws.prepare(request)
        protocol = ws.ws_protocol or ""
        self.execs.append((pod.name, list(command), protocol))
        pod.execs[ws] = (request.transport, list(command))
        try:
            await self._run_exec(pod, ws, command, stdin, protocol)
        finally:
            pod.execs.pop(ws, None)
        return ws

    async def _run_exec(self, pod: FakePod, ws: web.WebSocketResponse, command: list[str], stdin: bool,
                        protocol: str) -> None:
        loop = asyncio.get_running_loop()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            proc = await asyncio.create_subprocess_exec(
                "nsenter", "--target", str(pod.pid), "--net", "--pid", "--mount", "--uts", "--ipc", "--root",
                "--wd", "--", *command,
                stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL, stdout=out_w,
                stderr=err_w, env=pod.env, start_new_session=True)
        finally:
            os.close(out_w)
            os.close(err_w)
        readers: list[tuple[asyncio.StreamReader, asyncio.BaseTransport]] = []
        for fd in (out_r, err_r):
            reader = asyncio.StreamReader(limit=1 << 20)
            transport, _ = await loop.connect_read_pipe(lambda r=reader: asyncio.StreamReaderProtocol(r),  # type: ignore[misc]
                                                        os.fdopen(fd, "rb", 0))
            readers.append((reader, transport))
        last_rx = [time.monotonic()]

        async def pump(reader: asyncio.StreamReader, channel: int) -> None:
            with contextlib.suppress(Exception):  # the client went away: stop (the pipe closes below)
                while chunk := await reader.read(65536):
                    await ws.send_bytes(bytes([channel]) + chunk)

        async def receive() -> None:
            async for msg in ws:
                last_rx[0] = time.monotonic()
                if msg.type != WSMsgType.BINARY or not msg.data:
                    continue
                data: bytes = msg.data
                if data[0] == 0 and proc.stdin is not None and not proc.stdin.is_closing():
                    try:
                        proc.stdin.write(data[1:])
                        await proc.stdin.drain()  # backpressure: nothing more is read meanwhile
                    except (BrokenPipeError, ConnectionResetError):
                        proc.stdin.close()
                elif (data[0] == 255 and protocol.startswith("v5.") and data[1:] == b"\0"
                      and proc.stdin is not None):
                    proc.stdin.close()

        async def idle_watch() -> None:
            while True:
                if self.idle_timeout is None:
                    await asyncio.sleep(0.1)
                    continue
                left = last_rx[0] + self.idle_timeout - time.monotonic()
                if left <= 0:
                    self.idle_cuts += 1
                    if request_transport is not None:
                        request_transport.abort()  # type: ignore[attr-defined]
                    return
                await asyncio.sleep(min(left, 0.1))

        request_transport = pod.execs[ws][0]
        pumps = [asyncio.ensure_future(pump(r, ch)) for (r, _), ch in zip(readers, (1, 2), strict=True)]
        receiver = asyncio.ensure_future(receive())
        watcher = asyncio.ensure_future(idle_watch())
        done = asyncio.ensure_future(asyncio.gather(proc.wait(), *pumps))
        try:
            waiting: set[asyncio.Future[Any]] = {done, receiver}
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if done.done():
                rc = proc.returncode if proc.returncode is not None else -1
                code = rc if rc >= 0 else 128 - rc
                status: dict[str, Any] = {"metadata": {}, "status": "Success"}
                if code:
                    status = {"metadata": {}, "status": "Failure", "reason": "NonZeroExitCode",
                              "message": "command terminated with non-zero exit code: error "
                                         "executing command "
                                         f"{command}, exit code {code}",
                              "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]}}
                with contextlib.suppress(Exception):
                    await ws.send_bytes(b"\x03" + json.dumps(status).encode())
                    await ws.close()
        finally:
            # The client is gone or the command ended: its stdin ends, its output pipes close (a
            # writer left gets EPIPE), as a runtime does when the stream goes; the process lives on.
            if proc.stdin is not None:
                proc.stdin.close()
            for _, pipe in readers:
                pipe.close()
            for task in (receiver, watcher, *pumps):
                task.cancel()
            done.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(receiver, watcher, *pumps, done, return_exceptions=True)
            reaper = asyncio.ensure_future(proc.wait())  # reaped whenever it ends
            self._reapers.add(reaper)
            reaper.add_done_callback(self._reapers.discard)
