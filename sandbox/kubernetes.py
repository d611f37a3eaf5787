"""``KubernetesSandbox``: a pod per sandbox, driven through ``kubernetes_asyncio``.

Install with ``pip install kubernetes_asyncio`` (the ``kubernetes`` extra) and point it at a cluster with a
kubeconfig (``kubeconfig=``, else ``$KUBECONFIG``, else ``~/.kube/config``; inside a pod, its service
account).  Why ``kubernetes_asyncio`` and not the official synchronous ``kubernetes`` package: every
backend here is asyncio, and the exec tunnel is a long-lived, full-duplex byte stream.  The official
client's ``stream()`` runs ``websocket-client`` on a blocking socket that a thread must poll
(``update(timeout)``), with no backpressure towards the apiserver and a thread per tunnel;
``kubernetes_asyncio`` hands out the aiohttp WebSocket itself, read and written on the event loop.

What a sandbox is:

* a pod ``ares-sbx-<id>`` in ``namespace`` running the spec's image as root (its PID 1 a small shell
  that reaps orphans), the spec's resources as requests = limits (``cpu``, ``memory``,
  ``ephemeral-storage``, ``nvidia.com/gpu``), its environment, no service-account token and no service
  links; labels ``ares-gateway.sandbox=<id>`` (+ the session and the spec's labels that are valid label
  values) and every janitor label (owner, session, creation time) as annotations (an owner
  ``host:pid:start`` is no valid label value);
* with ``spec.network == "none"``: a ``NetworkPolicy`` ``ares-sbx-<id>-deny`` selecting exactly that
  pod, with policy types Ingress and Egress and no rule (all traffic denied), created *before* the pod
  and deleted with it.  The cluster's network plugin must enforce NetworkPolicies (Calico, Cilium, ...;
  kindnet and flannel do not).

Commands run over the exec API (a WebSocket, ``v5.channel.k8s.io`` preferred, ``v4`` otherwise; binary,
no TTY): a POSIX shell wrapper changes directory, switches user (``runuser``/``su``), starts the command
in its own session and records its process-group id, so that a timeout kills the whole group with a
second exec.  Files travel as tar streams over an exec's stdin/stdout, as ``kubectl cp`` does.
``forward()`` runs ``sandbox/_relay.py`` in tunnel mode as root on a long-lived exec and serves it with
:class:`sandbox.tunnel.Tunnel`; the tunnel's pings (every ``tunnel_ping_interval`` s, data on stdin and
stdout) keep the stream from the apiserver's and the kubelet's idle timeouts (the kubelet's
``streamingConnectionIdleTimeout`` defaults to 4 h).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import posixpath
import re
import secrets
import shlex
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import IO, Any, TypeVar
from urllib.parse import urlencode

from . import janitor
from ._procid import (
    EXEC_DIR_SH,
    KILL_ALL,
    KILL_TOKEN,
    RECORD_AND_EXEC,
    RELAY_RECORD,
    START_FN,
    USER_NAME_SH,
)
from ._relay import READER_LIMIT
from .errors import (
    BackendUnavailableError,
    ExecError,
    FileTransferError,
    ForwardError,
    SandboxStartError,
)
from .protocol import (
    BaseSandbox,
    ExecResult,
    command_to_shell,
    tar_single_file,
)
from .registry import import_sdk
from .spec import SandboxSpec
from .tunnel import Channel, ReaderFlow, Tunnel, TunnelError

T = TypeVar("T")

#: The exec subprotocols asked for, in order of preference (v5 can half-close stdin).
EXEC_PROTOCOLS = ("v5.channel.k8s.io", "v4.channel.k8s.io")
STDIN, STDOUT, STDERR, ERROR, CLOSE = 0, 1, 2, 3, 255

_CWD_MISSING = 201
_ARES_DIR = "/.ares"
_RELAY_SCRIPT = Path(__file__).with_name("_relay.py")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_WAITING_FAILURES = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
                     "CreateContainerError", "RunContainerError")

# PID 1 of the pod: waits forever, reaping whatever is orphaned into it (the shell's wait does), and
# ends at once on SIGTERM so that deleting the pod is quick.
_KEEPER = "trap 'exit 0' TERM INT; while :; do sleep 2147483647 & wait; done"

# $1 token, $2 cwd, $3 user ('' = the container's, root), $4 command, $5 RECORD_AND_EXEC.  Root
# records the command's session leader (pid and start time) in the root-only EXEC_DIR before the
# command switches user; a timeout kills by that record, never by a file the agent can write.
_WRAPPER = EXEC_DIR_SH + r"""
p="$_ed/$1.pid"; d=$2; u=$3; c=$4; rec=$5
""" + USER_NAME_SH + r"""
cd -- "$d" 2>/dev/null || { echo "ares-exec: no such directory: $d" >&2; exit 201; }
case "$u" in
  ""|root|0) set -- /bin/sh -c "$c";;
  *) if command -v runuser >/dev/null 2>&1; then set -- runuser -u "$u" -- /bin/sh -c "$c"
     else set -- su -s /bin/sh "$u" -c "$c"; fi;;
esac
if command -v setsid >/dev/null 2>&1; then
  setsid -w /bin/sh -c "$rec" "$p" "$@" </dev/null; rc=$?
else
  /bin/sh -c "$rec" "$p" "$@" </dev/null; rc=$?
fi
rm -f "$p"; exit $rc
"""
_KILL = KILL_TOKEN
# $1 dir, $2 bytes: unpack exactly $2 bytes of tar from stdin (v4 cannot end stdin: the length does).
_PUT = 'mkdir -p -- "$1" && head -c "$2" | tar -xof - -C "$1"'
# $1 port, $2 max streams: the exec tunnel's relay; a relay of this port left from a dropped channel
# (its exec not ended) is killed first, only while its record still names that very process.
_TUNNEL_RELAY = (
    'port=$1; d=/.ares; command -v python3 >/dev/null 2>&1 || { echo "the image has no python3, '
    'which the exec tunnel\'s relay needs" >&2; exit 3; }; ' + RELAY_RECORD
    + 'exec python3 -I /.ares/relay.py --listen "127.0.0.1:$port" --tunnel binary '
    '--ready-file "$d/relay-$port.pid" --max-connections "$2"'
)
# Prints "<pid> <start time>" of the pod's keeper (the sleep of PID 1's loop), once it has one.
_KEEPER_RECORD = START_FN + (
    'i=0; k=; while :; do read -r k </proc/1/task/1/children; [ -n "$k" ] && break; i=$((i+1)); '
    '[ $i -gt 250 ] && exit 3; sleep 0.02; done; set -- $k; l=; read -r l <"/proc/$1/stat" || exit 3; '
    '_ares_start "$l"; echo "$1 $t"'
)


def _sdk() -> Any:
    return import_sdk("kubernetes_asyncio", backend="Kubernetes", extra="kubernetes",
                      submodules=("client", "config", "stream"))


def _status_of(exc: BaseException) -> int | None:
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None


def _api_error(exc: BaseException) -> str:
    """What went wrong in an API call, without the request (its headers carry the token)."""
    status = _status_of(exc)
    if status is None:
        return f"{type(exc).__name__}: {exc}"
    body = getattr(exc, "body", None)
    message = ""
    if body:
        try:
            message = str(json.loads(body).get("message") or "")
        except (ValueError, AttributeError, TypeError):
            message = str(body)[:300]
    return f"HTTP {status} {getattr(exc, 'reason', '') or ''}".rstrip() + (f": {message}" if message else "")


def _kubeconfig_path(kubeconfig: str | os.PathLike[str] | None) -> tuple[str, bool]:
    """The kubeconfig to read, and whether to read it (given, or the default one exists)."""
    path = (str(kubeconfig) if kubeconfig else os.environ.get("KUBECONFIG")
            or os.path.expanduser("~/.kube/config"))
    return path, bool(kubeconfig) or os.path.exists(path.split(os.pathsep)[0])


async def load_configuration(kubeconfig: str | os.PathLike[str] | None = None,
                             context: str | None = None) -> Any:
    """A ``kubernetes_asyncio`` Configuration: from ``kubeconfig`` (else ``$KUBECONFIG``, else
    ``~/.kube/config``) and ``context``, else the in-cluster service account."""
    sdk = _sdk()
    cfg = sdk.client.Configuration()
    path, found = _kubeconfig_path(kubeconfig)
    if found:
        try:
            await sdk.config.load_kube_config(config_file=path, context=context, client_configuration=cfg)
        except Exception as exc:
            raise BackendUnavailableError(
                f"cannot load the kubeconfig {path}: {type(exc).__name__}: {exc}") from exc
        return cfg
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        sdk.config.load_incluster_config(client_configuration=cfg)
        return cfg
    raise BackendUnavailableError(
        "the Kubernetes backend needs a cluster: set KUBECONFIG (or pass kubeconfig=) to a kubeconfig file, "
        "or run inside a pod with a service account"
    )


def _ws_client_class() -> Any:
    ws_client = _sdk().stream.WsApiClient

    class _ExecApiClient(ws_client):  # type: ignore[misc,valid-type]
        """The SDK's WebSocket client, asking aiohttp for both exec subprotocols so that it reports
        the one the server chose (the parent sends ``v4`` only, as a bare header aiohttp ignores)."""

        async def request(self, method: str, url: str, query_params: Any = None, headers: Any = None,
                          post_params: Any = None, body: Any = None, _preload_content: bool = True,
                          _request_timeout: Any = None) -> Any:
            if _preload_content:
                return await super().request(method, url, query_params, headers, post_params, body,
                                             _preload_content, _request_timeout)
            params: list[tuple[str, Any]] = []
            for key, value in query_params or []:  # one "command" parameter per word, as the parent
                params.extend((key, v) for v in value) if key == "command" and isinstance(value, list) \
                    else params.append((key, value))
            headers = {k: v for k, v in (headers or {}).items() if k.lower() != "sec-websocket-protocol"}
            full = _sdk().stream.ws_client.get_websocket_url(url
                                                             + ("?" + urlencode(params) if params else ""))
            return self.rest_client.pool_manager.ws_connect(full, headers=headers, protocols=EXEC_PROTOCOLS,
                                                            heartbeat=self.heartbeat)

    return _ExecApiClient


class ExecStream:
    """One exec WebSocket: stdout into :attr:`stdout` (a StreamReader), stderr into :attr:`stderr`
    (the last ``stderr_cap`` bytes, all when ``None``), the exit status from channel 3 in
    :attr:`status`; :meth:`write` queues stdin, sent in messages of at most ``max_message`` bytes."""

    def __init__(self, ws: Any, *, stderr_cap: int | None = 64 * 1024, max_message: int = 128 * 1024,
                 high_water: int = 1024 * 1024) -> None:
        self.ws = ws
        self.protocol: str = ws.protocol or ""
        self.stdout = asyncio.StreamReader(limit=READER_LIMIT)
        self._resumer = ReaderFlow()
        self.stdout.set_transport(self._resumer)  # type: ignore[arg-type]
        self.stderr = bytearray()
        self.stderr_cap, self.max_message, self.high_water = stderr_cap, max_message, high_water
        loop = asyncio.get_running_loop()
        #: The exec's status (a metav1.Status dict); an exception if the stream ended without one.
        self.status: asyncio.Future[dict[str, Any]] = loop.create_future()
        self.ended: asyncio.Future[None] = loop.create_future()
        self._buf = bytearray()
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()
        self._drained.set()
        self._eof_wanted = False
        self.error: BaseException | None = None
        self.closed = False
        self._reader = asyncio.ensure_future(self._read())
        self._writer = asyncio.ensure_future(self._write())

    @property
    def can_close_stdin(self) -> bool:
        """Whether the protocol can half-close stdin (v5); on v4 only closing the stream ends it."""
        return self.protocol.startswith("v5.")

    # -- reading -----------------------------------------------------------------------------------
    async def _read(self) -> None:
        import aiohttp

        why: BaseException | None = None
        try:
            while True:
                await self._resumer.resumed.wait()
                msg = await self.ws.receive()
                if msg.type != aiohttp.WSMsgType.BINARY:
                    if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING,
                                    aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                        if msg.type == aiohttp.WSMsgType.ERROR:
                            why = (msg.data if isinstance(msg.data, BaseException)
                                   else ConnectionError(str(msg.data)))
                        break
                    continue  # text or control frames carry nothing for us
                data: bytes = msg.data
                if not data:
                    continue
                channel, payload = data[0], data[1:]
                if channel == STDOUT:
                    if payload:
                        self.stdout.feed_data(payload)
                elif channel == STDERR:
                    self.stderr += payload
                    if self.stderr_cap is not None:
                        del self.stderr[:-self.stderr_cap]
                elif channel == ERROR:
                    if not self.status.done():
                        try:
                            self.status.set_result(dict(json.loads(payload)))
                        except ValueError:
                            self.status.set_result(
                                {"status": "Failure", "message": payload[:500].decode(errors="replace")})
                elif channel == CLOSE and len(payload) == 1 and payload[0] == STDOUT:
                    self.stdout.feed_eof()
        except Exception as exc:  # the connection broke under us
            why = exc
        finally:
            if not self.stdout.at_eof():
                if why is not None:
                    self.stdout.set_exception(why if isinstance(why, Exception)
                                              else ConnectionError(str(why)))
                else:
                    self.stdout.feed_eof()
            if not self.status.done():
                self.status.set_exception(ConnectionError(
                    f"the exec stream ended without an exit status ({why or 'closed'})"))
                self.status.exception()  # retrieved: nobody may ask
            if not self.ended.done():
                self.ended.set_result(None)
            self._drained.set()
            self._wake.set()

    # -- writing (stdin) ---------------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        if self.closed or self.error is not None or self._eof_wanted or not data:
            return
        self._buf += data
        self._wake.set()
        if len(self._buf) > self.high_water:
            self._drained.clear()

    async def _write(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._buf:
                    chunk = bytes(self._buf[: self.max_message])
                    del self._buf[: len(chunk)]
                    if len(self._buf) <= self.high_water:
                        self._drained.set()
                    await self.ws.send_bytes(bytes([STDIN]) + chunk)
                if self._eof_wanted:
                    if self.can_close_stdin:
                        await self.ws.send_bytes(bytes([CLOSE, STDIN]))
                    return
                if self.ended.done():
                    return
        except Exception as exc:  # the connection is gone: writes are dropped from now on
            self.error = exc
            self._buf.clear()
            self._drained.set()

    @property
    def transport(self) -> ExecStream:  # what the tunnel's Mux asks for its backlog
        return self

    def get_write_buffer_size(self) -> int:
        return len(self._buf)

    async def drain(self) -> None:
        if self.error is not None:
            raise ConnectionResetError(f"the exec stream failed: {self.error}")
        if self.closed or self.ended.done():
            raise ConnectionResetError("the exec stream is closed")
        await self._drained.wait()
        if self.error is not None:
            raise ConnectionResetError(f"the exec stream failed: {self.error}")

    def close_stdin(self) -> None:
        """Send what is queued, then end stdin (v5; on v4 nothing more is sent)."""
        self._eof_wanted = True
        self._wake.set()

    async def flush(self, timeout: float) -> None:
        """Wait until stdin (and its end, on v5) went out."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self._writer), timeout)

    def close(self) -> None:
        """The writer's ``close()`` (what the Mux calls): nothing more goes out."""
        self.closed = True
        self._drained.set()

    async def aclose(self) -> None:
        """Close the WebSocket and stop both tasks."""
        self.close()
        with contextlib.suppress(Exception):
            await self.ws.close()
        for task in (self._reader, self._writer):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    async def wait_exit(self) -> int:
        """Read stdout to its end (what :meth:`collect` returns) and return the exit code."""
        status = await self.status
        return exit_code(status)

    async def collect(self) -> tuple[bytes, bytes, dict[str, Any]]:
        """All of stdout and stderr and the status, once the exec ended."""
        out = bytearray()
        while chunk := await self.stdout.read(1 << 20):
            out += chunk
        await self.ended
        return bytes(out), bytes(self.stderr), await self.status


def exit_code(status: dict[str, Any]) -> int:
    """The exit code in an exec's status (channel 3); raises :class:`ExecError` when the command did
    not run at all (the runtime refused it: not found, not executable)."""
    if status.get("status") == "Success":
        return 0
    if status.get("reason") == "NonZeroExitCode":
        for cause in (status.get("details") or {}).get("causes") or []:
            if cause.get("reason") == "ExitCode":
                return int(cause.get("message"))
    raise ExecError(f"the exec failed: {status.get('message') or status}")


def _label_value(value: str) -> str | None:
    return value if len(value) <= 63 and _LABEL_VALUE.match(value) else None


def _run_sync(factory: Callable[[], Coroutine[Any, Any, T]], timeout: float = 120.0) -> T:
    """Run a coroutine to its end from synchronous code (atexit, signal handlers, gc): on a fresh
    event loop in a thread of its own, whatever loop the caller may be running."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(asyncio.run(factory()))
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=run, name="kubernetes-sync", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"the Kubernetes API did not answer within {timeout:.0f} s")
    if error:
        raise error[0]
    return result[0]


def policy_name(pod: str) -> str:
    """The NetworkPolicy of a sandbox's pod."""
    return f"{pod}-deny"


async def _delete(api_client: Any, namespace: str, pod: str) -> None:
    """Delete the pod (at once) and its policy; either may be gone already."""
    sdk = _sdk()
    core, net = sdk.client.CoreV1Api(api_client), sdk.client.NetworkingV1Api(api_client)
    for call in (lambda: core.delete_namespaced_pod(pod, namespace, grace_period_seconds=0),
                 lambda: net.delete_namespaced_network_policy(policy_name(pod), namespace)):
        for attempt in range(4):
            try:
                await call()
                break
            except sdk.client.ApiException as exc:
                if exc.status == 404:
                    break
                if attempt == 3 or not (exc.status >= 500 or exc.status == 429):
                    raise
            except (TimeoutError, OSError):
                if attempt == 3:
                    raise
            await asyncio.sleep(0.3 * 2 ** attempt)


class KubernetesSandbox(BaseSandbox):
    """A sandbox in a Kubernetes pod (see the module's docstring).

    ``namespace`` (default ``$ARES_K8S_NAMESPACE``, else ``default``: where gc looks too), ``kubeconfig``
    and ``context`` select where; ``default_image`` (default ``$ARES_K8S_IMAGE``) is used when the spec
    names none (a Dockerfile cannot be built here: build and push it, then name the tag).  Limits:
    ``start_timeout`` for the pod to run (pulls included), ``tunnel_max_streams`` connections per
    forwarded port, ``tunnel_ping_interval`` s between the tunnel's pings (far below any idle timeout
    of the apiserver's or the kubelet's streams), ``max_message`` bytes per stdin message.
    """

    backend = "kubernetes"
    remote = True

    def __init__(
        self,
        spec: SandboxSpec | None = None,
        *,
        namespace: str | None = None,
        kubeconfig: str | os.PathLike[str] | None = None,
        context: str | None = None,
        default_image: str | None = None,
        start_timeout: float = 300.0,
        tunnel_max_streams: int = 256,
        tunnel_ping_interval: float = 15.0,
        max_message: int = 128 * 1024,
    ) -> None:
        super().__init__(spec)
        _sdk()
        if self.spec.dockerfile is not None:
            raise ValueError(
                "the Kubernetes backend runs images from a registry: build and push the Dockerfile, "
                "then pass SandboxSpec(image=<tag>)")
        self.image = self.spec.image or default_image or os.environ.get("ARES_K8S_IMAGE")
        if not self.image:
            raise ValueError(
                "the Kubernetes backend needs an image the cluster can pull: SandboxSpec(image=...), "
                "default_image=, $ARES_K8S_IMAGE or `ares-gateway run --image`")
        if start_timeout <= 0 or tunnel_ping_interval <= 0 or max_message < 1024 or tunnel_max_streams < 1:
            raise ValueError("start_timeout and tunnel_ping_interval must be positive, max_message >= 1024 "
                             "and tunnel_max_streams >= 1")
        self.namespace, self.kubeconfig, self.context = namespace or _gc_namespace(), kubeconfig, context
        self.start_timeout, self.max_message = start_timeout, max_message
        self.tunnel_max_streams, self.tunnel_ping_interval = tunnel_max_streams, tunnel_ping_interval
        self.pod_name = f"ares-sbx-{self.id}"
        self._cfg: Any = None
        self._api: Any = None
        self._ws: Any = None
        self._tunnels: dict[int, Tunnel] = {}
        self._relay_uploaded = False
        self._created: list[str] = []  # "policy", "pod": what to delete
        # "<pid> <start time>" of the pod's keeper sleep, recorded at start (before any command of the agent).
        self._keeper_record = ""

    @property
    def description(self) -> str:
        where = getattr(self._cfg, "host", None) or "the kubeconfig's cluster"
        return (f"kubernetes sandbox {self.id} (pod {self.namespace}/{self.pod_name}, image {self.image}, "
                f"{where}, network={self.spec.network}"
                + (", egress denied by a NetworkPolicy" if self.spec.network == "none" else "")
                + ("; forwards over an exec tunnel" if self._tunnels else "") + ")")

    def tunnel_for(self, port: int) -> Tunnel | None:
        """The exec tunnel serving ``port``, for its counters and tests."""
        return self._tunnels.get(port)

    # -- manifests ---------------------------------------------------------------------------------
    def _labels(self) -> tuple[dict[str, str], dict[str, str]]:
        """Labels (selectable, valid values only) and annotations (every janitor and spec label)."""
        annotations = {**self.labels(), janitor.SANDBOX_LABEL: self.id}
        labels = {k: v for k, v in self.spec.labels.items() if _label_value(v) is not None and len(k) <= 253}
        labels[janitor.SANDBOX_LABEL] = self.id
        labels[janitor.SESSION_LABEL] = janitor.session_id()
        return labels, annotations

    def pod_manifest(self) -> Any:
        """The V1Pod this sandbox creates."""
        client = _sdk().client
        labels, annotations = self._labels()
        res = self.spec.resources
        quantities: dict[str, str] = {}
        if res.cpus:
            quantities["cpu"] = f"{res.cpus:g}"
        if res.memory_bytes:
            quantities["memory"] = str(res.memory_bytes)
        if res.disk_bytes:
            quantities["ephemeral-storage"] = str(res.disk_bytes)
        limits = dict(quantities)
        if res.gpus:
            limits["nvidia.com/gpu"] = str(res.gpus)
        container = client.V1Container(
            name="sandbox", image=self.image, command=["/bin/sh", "-c", _KEEPER],
            working_dir=self.spec.workdir,
            env=[client.V1EnvVar(name=k, value=v) for k, v in self.spec.env.items()],
            resources=client.V1ResourceRequirements(requests=quantities or None, limits=limits or None),
            security_context=client.V1SecurityContext(run_as_user=0, run_as_group=0),
        )
        return client.V1Pod(
            api_version="v1", kind="Pod",
            metadata=client.V1ObjectMeta(name=self.pod_name, namespace=self.namespace, labels=labels,
                                         annotations=annotations),
            spec=client.V1PodSpec(containers=[container], restart_policy="Never",
                                  termination_grace_period_seconds=1,
                                  automount_service_account_token=False, enable_service_links=False),
        )

    def policy_manifest(self) -> Any:
        """The egress- (and ingress-) deny V1NetworkPolicy selecting exactly this sandbox's pod."""
        client = _sdk().client
        labels, annotations = self._labels()
        return client.V1NetworkPolicy(
            api_version="networking.k8s.io/v1", kind="NetworkPolicy",
            metadata=client.V1ObjectMeta(name=policy_name(self.pod_name), namespace=self.namespace,
                                         labels=labels, annotations=annotations),
            spec=client.V1NetworkPolicySpec(
                pod_selector=client.V1LabelSelector(match_labels={janitor.SANDBOX_LABEL: self.id}),
                policy_types=["Ingress", "Egress"], ingress=[], egress=[]),
        )

    # -- lifecycle ---------------------------------------------------------------------------------
    async def _start(self) -> None:
        self._cfg = await load_configuration(self.kubeconfig, self.context)
        try:
            await self._create()
        except BaseException:
            await self._close_clients()  # what was created goes in start()'s _remove_sync
            raise

    async def _create(self) -> None:
        sdk = _sdk()
        self._api = sdk.client.ApiClient(self._cfg)
        self._ws = _ws_client_class()(configuration=self._cfg)
        core, net = sdk.client.CoreV1Api(self._api), sdk.client.NetworkingV1Api(self._api)
        try:
            if self.spec.network == "none":  # before the pod: it never runs unconfined
                await net.create_namespaced_network_policy(self.namespace, self.policy_manifest())
                self._created.append("policy")
            await core.create_namespaced_pod(self.namespace, self.pod_manifest())
            self._created.append("pod")
        except sdk.client.ApiException as exc:
            raise SandboxStartError(f"Kubernetes could not create sandbox {self.pod_name} in namespace "
                                    f"{self.namespace}: {_api_error(exc)}") from exc
        except OSError as exc:
            raise SandboxStartError(f"the Kubernetes API at {self._cfg.host} is unreachable: {exc}") from exc
        await self._wait_running(core)
        r = await self._exec(f"mkdir -p {shlex.quote(self.spec.workdir)}", cwd="/", env={}, user=None,
                             timeout=60)
        if not r.ok:
            raise SandboxStartError(
                f"cannot create workdir {self.spec.workdir} in pod {self.pod_name}: {r.stderr.strip()}")
        code, out, err = await self._root(["/bin/sh", "-c", _KEEPER_RECORD], timeout=60)
        record = out.decode(errors="replace").strip()
        if code != 0 or len(record.split()) != 2 or not all(f.isdigit() for f in record.split()):
            raise SandboxStartError(
                f"cannot find the keeper process of pod {self.pod_name}: "
                f"{(record + err.decode(errors='replace')).strip()[-300:] or f'exit {code}'}")
        self._keeper_record = record

    async def _wait_running(self, core: Any) -> None:
        deadline = time.monotonic() + self.start_timeout
        delay = 0.1
        while True:
            try:
                pod = await core.read_namespaced_pod(self.pod_name, self.namespace)
            except _sdk().client.ApiException as exc:
                raise SandboxStartError(f"reading pod {self.pod_name} failed: {_api_error(exc)}") from exc
            phase = pod.status.phase if pod.status else None
            statuses = (pod.status.container_statuses if pod.status else None) or []
            if phase == "Running" and all(s.state is None or s.state.running is not None for s in statuses):
                return
            for s in statuses:
                waiting = s.state.waiting if s.state else None
                if waiting is not None and waiting.reason in _WAITING_FAILURES:
                    raise SandboxStartError(
                        f"pod {self.pod_name} cannot start: {waiting.reason}: {waiting.message or ''}")
            if phase in ("Failed", "Succeeded"):
                raise SandboxStartError(
                    f"pod {self.pod_name} ended before it ran ({phase}): "
                    f"{(pod.status.message or pod.status.reason or '') if pod.status else ''}")
            if time.monotonic() > deadline:
                raise SandboxStartError(
                    f"pod {self.pod_name} was not running after {self.start_timeout:.0f} s "
                    f"(phase {phase}): raise start_timeout or check the cluster")
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 2.0)

    async def _stop(self) -> None:
        tunnels, self._tunnels = list(self._tunnels.values()), {}
        for tunnel in tunnels:
            with contextlib.suppress(Exception):
                await tunnel.close()
        try:
            if self._created and self._api is not None:
                await _delete(self._api, self.namespace, self.pod_name)
                self._created.clear()
        except Exception:
            await asyncio.to_thread(self._remove_sync)
        finally:
            await self._close_clients()

    async def _close_clients(self) -> None:
        for c in (self._ws, self._api):
            if c is not None:
                with contextlib.suppress(Exception):
                    await c.close()
        self._ws = self._api = None

    def _remove_sync(self) -> None:
        """Delete the pod and policy on a fresh client (safe from signal handlers and atexit)."""
        if not self._created or self._cfg is None:
            return
        cfg, namespace, pod = self._cfg, self.namespace, self.pod_name

        async def delete() -> None:
            api = _sdk().client.ApiClient(cfg)
            try:
                await _delete(api, namespace, pod)
            finally:
                await api.close()

        _run_sync(delete)
        self._created.clear()

    # -- exec --------------------------------------------------------------------------------------
    async def open_exec(self, argv: list[str], *, stdin: bool,
                        stderr_cap: int | None = 64 * 1024) -> ExecStream:
        """Start ``argv`` in the pod (as the container's user, root) on a new exec WebSocket."""
        sdk = _sdk()
        api = sdk.client.CoreV1Api(self._ws)
        try:
            ctx = await api.connect_get_namespaced_pod_exec(
                self.pod_name, self.namespace, command=argv, container="sandbox", stdin=stdin, stdout=True,
                stderr=True, tty=False, _preload_content=False)
            ws = await ctx
        except Exception as exc:
            # Never the exception's text alone: aiohttp's names the URL, which carries the command.
            status = getattr(exc, "status", None)
            what = f"HTTP {status}" if status else type(exc).__name__
            raise ExecError(f"exec in pod {self.namespace}/{self.pod_name} failed: {what}"
                            + (f" ({getattr(exc, 'message', '')})" if getattr(exc, "message", "")
                               else "")) from None
        return ExecStream(ws, stderr_cap=stderr_cap, max_message=self.max_message)

    async def _exec(
        self, command: str, *, cwd: str, env: dict[str, str], user: str | None, timeout: float | None
    ) -> ExecResult:
        pidfile = secrets.token_hex(12)  # the record's name in the root-only EXEC_DIR
        exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in env.items())
        argv = ["/bin/sh", "-c", _WRAPPER, "ares-exec", pidfile, cwd, user or "", exports + command,
                RECORD_AND_EXEC]
        started = time.monotonic()
        stream = await self.open_exec(argv, stdin=False, stderr_cap=None)
        collect = asyncio.ensure_future(stream.collect())
        timed_out = False
        result: tuple[bytes, bytes, dict[str, Any]] | None = None
        try:
            result = await asyncio.wait_for(asyncio.shield(collect), timeout)
        except TimeoutError:
            timed_out = True
            await self._kill_group(pidfile)
            with contextlib.suppress(Exception):  # something that left the group may hold stdout open
                result = await asyncio.wait_for(asyncio.shield(collect), 10)
        except asyncio.CancelledError:
            await self._kill_group(pidfile)
            await stream.aclose()
            raise
        except ConnectionError as exc:
            raise ExecError(f"the exec stream of pod {self.pod_name} broke: {exc}") from exc
        finally:
            await stream.aclose()
            collect.cancel()
        if result is None:
            stdout, stderr, code = b"", bytes(stream.stderr), -9
        else:
            stdout, stderr, status = result
            code = -9 if timed_out else exit_code(status)
        text_err = stderr.decode("utf-8", "replace")
        if code == _CWD_MISSING and text_err.startswith("ares-exec: no such directory"):
            raise ExecError(f"cwd {cwd!r} does not exist in sandbox {self.id}: create it first (mkdir -p)")
        return ExecResult(stdout=stdout.decode("utf-8", "replace"), stderr=text_err, exit_code=code,
                          timed_out=timed_out, duration=time.monotonic() - started)

    async def _kill_group(self, pidfile: str) -> None:
        with contextlib.suppress(Exception):
            await self._root(["/bin/sh", "-c", _KILL, pidfile], timeout=30)

    async def _root(self, argv: list[str], *, stdin: IO[bytes] | None = None, size: int = 0,
                    timeout: float = 600) -> tuple[int, bytes, bytes]:
        """One of the backend's own steps as root: ``stdin`` streamed in, all output collected."""
        stream = await self.open_exec(argv, stdin=stdin is not None, stderr_cap=64 * 1024)
        try:
            async def run() -> tuple[int, bytes, bytes]:
                if stdin is not None:
                    sent = 0
                    with contextlib.suppress(ConnectionError):  # it ended early: its status says why
                        while sent < size:
                            chunk = await asyncio.to_thread(stdin.read, min(1 << 20, size - sent))
                            if not chunk:
                                break
                            sent += len(chunk)
                            stream.write(chunk)
                            await stream.drain()
                    stream.close_stdin()
                out, err, status = await stream.collect()
                return exit_code(status), out, err

            return await asyncio.wait_for(run(), timeout)
        except (ConnectionError, TimeoutError) as exc:
            raise ExecError(f"exec in pod {self.pod_name} broke: {exc or type(exc).__name__}") from exc
        finally:
            await stream.aclose()

    # -- files -------------------------------------------------------------------------------------
    async def _put_tar(self, remote_dir: str, tar_stream: IO[bytes]) -> None:
        try:
            size = tar_stream.seek(0, os.SEEK_END)
            tar_stream.seek(0)
            code, out, err = await self._root(["/bin/sh", "-c", _PUT, "ares-put", remote_dir, str(size)],
                                              stdin=tar_stream, size=size)
        finally:
            tar_stream.close()
        if code != 0:
            raise FileTransferError(f"copying into {remote_dir} in sandbox {self.id} failed: "
                                    f"{(out + err).decode(errors='replace').strip()[-500:]}")

    async def _uploaded(self, remote: str) -> None:
        if self.spec.user:
            code, _, err = await self._root(["chown", "-R", self.spec.user, remote])
            if code != 0:
                raise FileTransferError(
                    f"giving {remote} to {self.spec.user} failed: {err.decode(errors='replace')}")

    async def _get_tar(self, directory: str, name: str) -> IO[bytes]:
        """``tar -c`` of ``name`` in ``directory``, spooled here (to disk when large)."""
        stream = await self.open_exec(["tar", "-cf", "-", "-C", directory, name], stdin=False)
        spool = tempfile.SpooledTemporaryFile(max_size=32 * 1024 * 1024)
        try:
            while chunk := await stream.stdout.read(1 << 20):
                spool.write(chunk)
            await stream.ended
            code = exit_code(await stream.status)
        except ConnectionError as exc:
            spool.close()
            raise FileTransferError(
                f"copying {directory}/{name} out of sandbox {self.id} broke: {exc}") from exc
        finally:
            await stream.aclose()
        if code != 0:
            spool.close()
            raise FileTransferError(
                f"copying {posixpath.join(directory, name)} out of sandbox {self.id} failed: "
                f"{bytes(stream.stderr).decode(errors='replace').strip()[-500:]}")
        spool.seek(0)
        return spool  # type: ignore[return-value]

    # -- forwarding and killing --------------------------------------------------------------------
    async def open_exec_channel(self, argv: list[str]) -> Channel:
        """``argv`` on a long-lived exec (stdin attached, no TTY) as a :class:`~sandbox.tunnel.Channel`:
        stdout is the channel's reader, stdin its writer.  Closing it ends stdin (v5) and waits a
        moment for the exec to end (the relay exits on that EOF) before closing the WebSocket, which
        on v4 is what ends stdin."""
        stream = await self.open_exec(argv, stdin=True)
        closed: list[bool] = []

        async def close() -> None:
            if closed:
                return
            closed.append(True)
            if stream.can_close_stdin and not stream.ended.done():
                stream.close_stdin()
                await stream.flush(2.0)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(stream.ended), 2.0)
            await stream.aclose()

        return Channel(stream.stdout, stream, close, f"kubernetes exec in {self.namespace}/{self.pod_name} "
                       f"({stream.protocol or 'no subprotocol'})", stream.stderr)

    async def _upload_relay(self) -> None:
        data = _RELAY_SCRIPT.read_bytes()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "relay.py"
            path.write_bytes(data)
            tar_stream = tar_single_file(path, "relay.py")
        code, out, err = await self._root(
            ["/bin/sh", "-c", f"mkdir -p -m 755 {_ARES_DIR} && " + _PUT, "ares-put",
             _ARES_DIR, str(_size(tar_stream))], stdin=tar_stream, size=_size(tar_stream))
        tar_stream.close()
        if code != 0:
            raise ForwardError(f"copying the relay into sandbox {self.id} failed: "
                               f"{(out + err).decode(errors='replace')[-300:]}")
        await self._root(["chmod", "644", f"{_ARES_DIR}/relay.py"])

    async def _forward(self, port: int, host_socket: str) -> None:
        """A relay in tunnel mode on a root exec that stays open; its pid file spares it in
        kill_processes().  Another exec replaces it when the stream drops (see sandbox.tunnel)."""
        code, _, _ = await self._root(["/bin/sh", "-c", "command -v python3"], timeout=60)
        if code != 0:
            raise ForwardError(
                f"the image of sandbox {self.id} has no python3, which the exec tunnel's relay needs: "
                "use an image with python3")
        if not self._relay_uploaded:
            await self._upload_relay()
            self._relay_uploaded = True
        argv = ["/bin/sh", "-c", _TUNNEL_RELAY, "ares-relay", str(port), str(self.tunnel_max_streams)]
        tunnel = Tunnel(lambda: self.open_exec_channel(argv), host_socket,
                        max_streams=self.tunnel_max_streams, ping_interval=self.tunnel_ping_interval)
        try:
            await tunnel.start()
        except (TunnelError, OSError, ExecError) as exc:
            raise ForwardError(
                f"the exec tunnel for port {port} of sandbox {self.id} did not start: {exc}") from exc
        self._tunnels[port] = tunnel

    async def _kill_processes(self, user: str | None, timeout: float) -> int:
        uid = ""
        if user is not None:
            if user.isdigit():
                uid = user
            else:
                r = await self._exec(command_to_shell(["id", "-u", user]), cwd="/", env={}, user=None,
                                     timeout=30)
                if not r.ok:
                    raise ExecError(f"no user {user!r} in sandbox {self.id}: {r.stderr.strip()}")
                uid = r.stdout.strip()
        rounds = max(1, int(timeout / 0.05))
        if not self._keeper_record:
            raise ExecError(
                f"sandbox {self.id}: the pod's keeper was never recorded; kill_processes() needs it")
        code, out, err = await self._root(["/bin/sh", "-c", KILL_ALL, "ares-kill", uid, str(rounds),
                                           self._keeper_record], timeout=timeout + 30)
        text = out.decode(errors="replace").strip()
        if code != 0 or not text.isdigit():
            raise ExecError(f"killing the processes of sandbox {self.id} failed: "
                            f"{(text + err.decode(errors='replace')).strip()[-500:]}")
        return int(text)


def _size(stream: IO[bytes]) -> int:
    pos = stream.tell()
    end = stream.seek(0, os.SEEK_END)
    stream.seek(pos)
    return end


# -- garbage collection hooks (see janitor.collect_garbage) ------------------------------------------


def _gc_namespace() -> str:
    return os.environ.get("ARES_K8S_NAMESPACE") or "default"


def gc_candidates() -> list[tuple[str, dict[str, str]]]:
    """Every sandbox pod or policy in ``$ARES_K8S_NAMESPACE`` (default ``default``) of the kubeconfig's
    cluster: ``(namespace/pod, janitor labels)``; a policy whose pod was never created counts too."""
    namespace = _gc_namespace()

    async def listing() -> list[tuple[str, dict[str, str]]]:
        sdk = _sdk()
        api = sdk.client.ApiClient(await load_configuration())
        try:
            core, net = sdk.client.CoreV1Api(api), sdk.client.NetworkingV1Api(api)
            found: dict[str, dict[str, str]] = {}
            pods = await core.list_namespaced_pod(namespace, label_selector=janitor.SANDBOX_LABEL)
            policies = await net.list_namespaced_network_policy(namespace,
                                                                label_selector=janitor.SANDBOX_LABEL)
            for items, suffix in ((policies.items, "-deny"), (pods.items, "")):
                for item in items:
                    meta = item.metadata
                    labels = dict(meta.annotations or {})
                    if janitor.OWNER_LABEL in labels and meta.name.endswith(suffix):
                        found[f"{namespace}/{meta.name[: len(meta.name) - len(suffix)]}"] = labels
            return sorted(found.items())
        finally:
            await api.close()

    return _run_sync(listing)


def gc_remove(ref: str) -> None:
    """Delete the pod ``namespace/name`` and its policy."""
    namespace, _, pod = ref.partition("/")
    if not pod:
        raise ValueError(f"expected namespace/pod, got {ref!r}")

    async def delete() -> None:
        api = _sdk().client.ApiClient(await load_configuration())
        try:
            await _delete(api, namespace, pod)
        finally:
            await api.close()

    _run_sync(delete)


__all__ = ["EXEC_PROTOCOLS", "ExecStream", "KubernetesSandbox", "exit_code", "gc_candidates", "gc_remove",
           "load_configuration", "policy_name"]
