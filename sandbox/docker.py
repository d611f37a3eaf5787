"""``DockerSandbox``: one container per sandbox, driven through the ``docker`` SDK.

Every SDK call runs off the event loop (``asyncio.to_thread``).  The container runs ``sleep infinity``
under ``docker-init`` and commands run with ``docker exec``: each in its own session (``setsid``), its
process-group id written to a pid file so that a timeout kills the whole group inside the container.
Images come from a tag, or are built from a Dockerfile and cached under a tag derived from the
content hash of the Dockerfile and its build context.  Only idempotent calls (create, inspect, remove,
image lookups) are retried; an exec is never re-run.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import os
import posixpath
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import requests.exceptions
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential

from . import janitor
from .errors import (
    BackendUnavailableError,
    ExecError,
    FileTransferError,
    ForwardError,
    ImageBuildError,
    SandboxStartError,
)
from .protocol import (
    BaseSandbox,
    ExecResult,
    IterStream,
    command_to_shell,
    extract_single_file,
    extract_tar,
    tar_directory,
    tar_single_file,
)
from .spec import SandboxSpec

# The SDK is imported by name at run time: the repository's own docker/ directory (Dockerfiles)
# would otherwise shadow it for type checkers.
docker: Any = importlib.import_module("docker")
importlib.import_module("docker.errors")
importlib.import_module("docker.types")

T = TypeVar("T")

BUILD_TAG_PREFIX = "ares-gateway/sandbox-build"
_API_TIMEOUT = 120
_PIDDIR = "/tmp"

# Run `command` ($2) in a new session whose leader writes its pid (= the process-group id) to $1.
# The outer shell waits (setsid -w), removes the pid file and exits with the command's status.
_OUTER = (
    'p=$1; c=$2; i=$3; '
    'if command -v setsid >/dev/null 2>&1; then setsid -w /bin/sh -c "$i" "$p" "$c"; rc=$?; '
    'else /bin/sh -c "$i" "$p" "$c"; rc=$?; fi; rm -f "$p"; exit $rc'
)
_INNER = 'echo $$ >"$0" 2>/dev/null; exec /bin/sh -c "$1"'
_KILL = 'p=$(cat "$0" 2>/dev/null) && [ -n "$p" ] && { kill -9 -"$p" 2>/dev/null || kill -9 "$p"; }; rm -f "$0"'

# Root-owned directory of the sandbox's own machinery: the relay script, its pid files and logs, and
# the read-only mounts of host socket directories (/.ares/forward/<n>).
_ARES_DIR = "/.ares"
_RELAY_SCRIPT = Path(__file__).with_name("_relay.py")
# $1 port, $2 socket path inside.  Starts the relay detached and waits for its pid (ready) file.
_START_RELAY = r"""
port=$1; sock=$2; r=/.ares/relay-$port.pid; log=/.ares/relay-$port.log
command -v python3 >/dev/null 2>&1 || { echo "the image has no python3, which the relay needs"; exit 3; }
rm -f "$r"
setsid python3 -I /.ares/relay.py --listen "127.0.0.1:$port" --unix "$sock" --ready-file "$r" >"$log" 2>&1 </dev/null &
i=0; while [ ! -f "$r" ] && [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); done
[ -f "$r" ] || { cat "$log"; exit 4; }
"""
# $1 uid ('' = every user), $2 rounds of 50 ms.  Kills every process but PID 1, its first child (the
# container's `sleep infinity`), the relays and itself (with the exec wrapper above it); builtins only while listing, so the script's
# own helpers never show up.  Prints the number killed; exit 3 (and the survivors) when time runs out.
_KILL_ALL = r"""
want=$1; rounds=$2; self=$$; killed=0
keeper=$(tr ' ' '
' </proc/1/task/1/children | grep . | sort -n | head -n 1)
relays=$(cat /.ares/relay-*.pid 2>/dev/null | tr '
' ' ')
anc=""; p=$self
while [ -n "$p" ] && [ "$p" -gt 1 ]; do
  anc="$anc $p"; pp=""
  while read -r k v _; do case $k in PPid:) pp=$v; break;; esac; done <"/proc/$p/status" 2>/dev/null
  p=$pp
done
keep=" 1 $keeper $relays $anc "
n=0
while :; do
  list=""
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    case "$keep" in *" $p "*) continue;; esac
    st=""; u=""
    while read -r k v _; do
      case $k in State:) st=$v;; Uid:) u=$v; break;; esac
    done <"$d/status" 2>/dev/null || continue
    case $st in Z|X|"") continue;; esac
    [ -n "$want" ] && [ "$u" != "$want" ] && continue
    list="$list $p"
  done
  [ -z "$list" ] && { echo "$killed"; exit 0; }
  n=$((n+1)); [ $n -gt "$rounds" ] && { echo "survivors:$list"; exit 3; }
  for p in $list; do kill -9 "$p" 2>/dev/null && killed=$((killed+1)); done
  sleep 0.05
done
"""


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, (requests.exceptions.ConnectionError, requests.exceptions.Timeout)):
        return True
    if isinstance(exc, docker.errors.APIError) and not isinstance(exc, docker.errors.NotFound):
        code = exc.status_code or 0
        return code >= 500 and "No such" not in str(exc) and "is already in use" not in str(exc)
    return False


_retry = retry(
    retry=retry_if_exception(_transient),
    stop=stop_after_attempt(4),
    wait=wait_exponential(multiplier=0.2, max=3),
    reraise=True,
)

_client_lock = threading.Lock()
_clients: dict[int, Any] = {}
_build_locks: dict[str, threading.Lock] = {}


def client() -> Any:
    """A Docker client for this process (``DOCKER_HOST`` or the default socket)."""
    with _client_lock:
        cached = _clients.get(os.getpid())
        if cached is None:
            try:
                cached = docker.from_env(timeout=_API_TIMEOUT)
            except docker.errors.DockerException as exc:
                raise BackendUnavailableError(_unavailable_message(exc)) from exc
            _clients.clear()
            _clients[os.getpid()] = cached
        return cached


def _unavailable_message(exc: BaseException) -> str:
    return (
        f"no Docker engine answers ({exc}). Start one (e.g. `dockerd --bridge=none --iptables=false &`, "
        "or `bash .ci/provision-docker.sh`), or point DOCKER_HOST at one, or use backend='local'"
    )


def engine_available(timeout: float = 3.0) -> bool:
    """Whether a Docker engine answers a ping within ``timeout`` seconds."""
    try:
        probe = docker.from_env(timeout=int(max(1, timeout)))
        try:
            return bool(probe.ping())
        finally:
            probe.close()
    except Exception:
        return False


def _wrap_api_errors(what: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
    def deco(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> T:
            try:
                return fn(*args, **kwargs)
            except (requests.exceptions.ConnectionError, docker.errors.DockerException) as exc:
                if isinstance(exc, requests.exceptions.ConnectionError):
                    raise BackendUnavailableError(_unavailable_message(exc)) from exc
                raise SandboxStartError(f"{what} failed: {exc}") from exc

        return inner

    return deco


def image_for(spec: SandboxSpec, *, pull: bool = False) -> str:
    """The image tag to run for ``spec``, building it from its Dockerfile when not cached yet."""
    api = client()
    if spec.dockerfile:
        tag = f"{BUILD_TAG_PREFIX}:{spec.dockerfile_hash()[:20]}"
        with _client_lock:
            lock = _build_locks.setdefault(tag, threading.Lock())
        with lock:
            if _image_exists(api, tag):
                return tag
            _build(api, spec, tag)
        return tag
    image = spec.image or "ares-gateway/agent-base:latest"
    if _image_exists(api, image):
        return image
    if pull or os.environ.get("ARES_DOCKER_PULL") == "1":
        try:
            _retry(api.images.pull)(image)
            return image
        except docker.errors.DockerException as exc:
            raise SandboxStartError(f"cannot pull image {image!r}: {exc}") from exc
    raise SandboxStartError(
        f"image {image!r} is not on this Docker engine. Build it (docker/build-base-image.sh, then "
        f"docker build -t {image} docker/agent), pull it (pull=True or ARES_DOCKER_PULL=1), or use "
        "SandboxSpec(dockerfile=...)"
    )


@_retry
def _image_exists(api: Any, tag: str) -> bool:
    try:
        api.images.get(tag)
        return True
    except docker.errors.ImageNotFound:
        return False


def _build(api: Any, spec: SandboxSpec, tag: str) -> None:
    dockerfile = spec.dockerfile_path()
    context = spec.context_path()
    assert dockerfile is not None and context is not None
    log: list[str] = []
    try:
        stream = api.api.build(
            path=str(context),
            dockerfile=str(dockerfile),
            tag=tag,
            network_mode="host",
            rm=True,
            forcerm=True,
            decode=True,
            labels={"ares-gateway.dockerfile-hash": tag.rsplit(":", 1)[1]},
        )
        for chunk in stream:
            if "stream" in chunk:
                log.append(str(chunk["stream"]))
            if "error" in chunk:
                raise ImageBuildError(
                    f"building {dockerfile} failed: {chunk['error'].strip()}\n--- build log tail ---\n"
                    + "".join(log[-20:])
                )
    except docker.errors.DockerException as exc:
        raise ImageBuildError(f"building {dockerfile} failed: {exc}") from exc
    if not _image_exists(api, tag):
        raise ImageBuildError(f"building {dockerfile} produced no image:\n" + "".join(log[-20:]))


class DockerSandbox(BaseSandbox):
    backend = "docker"

    def __init__(self, spec: SandboxSpec | None = None, *, pull: bool = False) -> None:
        super().__init__(spec)
        self.pull = pull
        self.container_id: str | None = None
        self.image: str | None = None
        self._container_name = f"ares-sbx-{self.id}"
        # Host directory of a forwarded socket -> where it is mounted inside (read-only).
        self._socket_dirs: dict[str, str] = {}
        for n, directory in enumerate(sorted({os.path.dirname(p) for p in self.spec.forwards.values()})):
            self._socket_dirs[directory] = f"{_ARES_DIR}/forward/{n}"
        self._relay_uploaded = False

    @property
    def description(self) -> str:
        target = self.image or self.spec.image or self.spec.dockerfile
        return f"docker sandbox {self.id} (container {self._container_name}, image {target}, network={self.spec.network})"

    # -- lifecycle ---------------------------------------------------------------------------------
    async def _start(self) -> None:
        self.image = await asyncio.to_thread(image_for, self.spec, pull=self.pull)
        self.container_id = await asyncio.to_thread(self._create_container)

    @_wrap_api_errors("creating the container")
    def _create_container(self) -> str:
        api = client()
        res = self.spec.resources
        kwargs: dict[str, Any] = {
            "image": self.image,
            "entrypoint": ["sleep", "infinity"],
            "command": [],
            "name": self._container_name,
            "labels": {**self.labels(), janitor.SANDBOX_LABEL: self.id},
            "environment": dict(self.spec.env),
            "working_dir": self.spec.workdir,
            "network_mode": self.spec.network,
            "init": True,
            "detach": True,
        }
        if self._socket_dirs:
            kwargs["volumes"] = {host: {"bind": inside, "mode": "ro"} for host, inside in self._socket_dirs.items()}
        if res.cpus:
            kwargs["nano_cpus"] = int(res.cpus * 1e9)
        if res.memory_bytes:
            kwargs["mem_limit"] = res.memory_bytes
            kwargs["memswap_limit"] = res.memory_bytes
        if res.disk_bytes:
            kwargs["storage_opt"] = {"size": str(res.disk_bytes)}
        if res.gpus:
            kwargs["device_requests"] = [docker.types.DeviceRequest(count=res.gpus, capabilities=[["gpu"]])]

        @_retry
        def create() -> str:
            try:
                container = api.containers.run(**kwargs)
            except docker.errors.APIError as exc:
                if exc.status_code == 409:  # an earlier attempt did create it: adopt it
                    container = api.containers.get(self._container_name)
                    container.start()
                else:
                    raise
            return str(container.id)

        return create()

    def _remove_sync(self) -> None:
        name = self.container_id or self._container_name
        # A fresh client: this may run in a signal handler while another call holds the shared one.
        try:
            fresh = docker.from_env(timeout=30)
        except docker.errors.DockerException:
            return
        try:
            _retry(_remove_container)(fresh, name)
        finally:
            fresh.close()

    # -- exec ---------------------------------------------------------------------------------------
    async def _exec(
        self, command: str, *, cwd: str, env: dict[str, str], user: str | None, timeout: float | None
    ) -> ExecResult:
        assert self.container_id is not None
        pidfile = f"{_PIDDIR}/.ares-exec-{uuid.uuid4().hex}.pid"
        argv = ["/bin/sh", "-c", _OUTER, "ares-exec", pidfile, command, _INNER]
        api = client().api
        started = time.monotonic()
        exec_id = await asyncio.to_thread(self._exec_create, api, argv, cwd, env, user)
        stream = await asyncio.to_thread(api.exec_start, exec_id, stream=True, demux=True)
        out: list[bytes] = []
        err: list[bytes] = []
        reader = asyncio.ensure_future(asyncio.to_thread(_drain, stream, out, err))
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.shield(reader), timeout)
        except TimeoutError:
            timed_out = True
        except asyncio.CancelledError:
            await asyncio.to_thread(self._kill_group, pidfile)
            stream.close()
            raise
        if timed_out:
            await asyncio.to_thread(self._kill_group, pidfile)
            try:
                await asyncio.wait_for(asyncio.shield(reader), 10)
            except TimeoutError:  # something that left the group still holds the output open
                stream.close()
                with contextlib.suppress(Exception):
                    await reader
        info = await asyncio.to_thread(api.exec_inspect, exec_id)
        code = info.get("ExitCode")
        stdout = b"".join(out).decode("utf-8", "replace")
        stderr = b"".join(err).decode("utf-8", "replace")
        if code in (126, 127) and "OCI runtime exec failed" in stdout + stderr:
            raise ExecError(f"docker could not run the command in sandbox {self.id}: {(stdout + stderr).strip()}")
        return ExecResult(
            stdout=stdout,
            stderr=stderr,
            exit_code=-9 if timed_out else (code if code is not None else -1),
            timed_out=timed_out,
            duration=time.monotonic() - started,
        )

    def _exec_create(self, api: Any, argv: list[str], cwd: str, env: dict[str, str], user: str | None) -> str:
        try:
            res = api.exec_create(
                self.container_id, argv, stdout=True, stderr=True, stdin=False, tty=False,
                environment=env, workdir=cwd, user=user or "",
            )
        except docker.errors.NotFound as exc:
            raise ExecError(f"container of sandbox {self.id} is gone ({exc}); create a new sandbox") from exc
        except docker.errors.APIError as exc:
            raise ExecError(f"docker exec in sandbox {self.id} failed: {exc}") from exc
        return str(res["Id"])

    def _kill_group(self, pidfile: str) -> None:
        with contextlib.suppress(docker.errors.DockerException, requests.exceptions.RequestException):
            client().api.exec_start(
                client().api.exec_create(self.container_id, ["/bin/sh", "-c", _KILL, pidfile], user="root")["Id"]
            )

    # -- forwarding and killing -------------------------------------------------------------------
    async def _forward(self, port: int, host_socket: str) -> None:
        directory, name = os.path.split(host_socket)
        inside = self._socket_dirs.get(directory)
        if inside is None:
            raise ForwardError(
                f"docker can forward only sockets in directories mounted when the container was created: put "
                f"{host_socket} in SandboxSpec.forwards (or in the directory of a socket there: "
                f"{sorted(self._socket_dirs) or 'none'})"
            )
        if not self._relay_uploaded:
            await asyncio.to_thread(self._upload_relay)
            self._relay_uploaded = True
        r = await self._exec(command_to_shell(["sh", "-c", _START_RELAY, "ares-relay", str(port), f"{inside}/{name}"]),
                             user="root", cwd="/", env={}, timeout=60)
        if not r.ok:
            raise ForwardError(f"the relay for port {port} of sandbox {self.id} did not start: "
                               f"{(r.stdout + r.stderr).strip()[-500:] or f'exit {r.exit_code}'}")

    def _upload_relay(self) -> None:
        import io
        import tarfile

        data = _RELAY_SCRIPT.read_bytes()
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo("relay.py")
            info.size, info.mode, info.uid, info.gid = len(data), 0o644, 0, 0
            tar.addfile(info, io.BytesIO(data))
        api = client().api
        api.exec_start(api.exec_create(self.container_id, ["mkdir", "-p", "-m", "755", _ARES_DIR], user="root")["Id"])
        if not api.put_archive(self.container_id, _ARES_DIR, buf.getvalue()):
            raise ForwardError(f"docker refused the relay script's copy into sandbox {self.id}")

    async def _kill_processes(self, user: str | None, timeout: float) -> int:
        uid = ""
        if user is not None:
            if user.isdigit():
                uid = user
            else:
                r = await self._exec(command_to_shell(["id", "-u", user]), user="root", cwd="/", env={}, timeout=30)
                if not r.ok:
                    raise ExecError(f"no user {user!r} in sandbox {self.id}: {r.stderr.strip()}")
                uid = r.stdout.strip()
        rounds = max(1, int(timeout / 0.05))
        r = await self._exec(command_to_shell(["sh", "-c", _KILL_ALL, "ares-kill", uid, str(rounds)]), user="root",
                             cwd="/", env={}, timeout=timeout + 30)
        out = r.stdout.strip()
        if not r.ok or not out.isdigit():
            raise ExecError(f"killing the processes of sandbox {self.id} failed: {(out + r.stderr).strip()[-500:]}")
        return int(out)

    async def _run_root(self, argv: list[str], what: str) -> None:
        assert self.container_id is not None

        def run() -> tuple[int, bytes]:
            container = client().containers.get(self.container_id)
            code, output = container.exec_run(argv, user="root")
            return int(code), output

        code, output = await asyncio.to_thread(run)
        if code != 0:
            raise FileTransferError(f"{what} in sandbox {self.id} failed: {output.decode(errors='replace').strip()}")

    # -- files ----------------------------------------------------------------------------------------
    async def _put_tar(self, remote_dir: str, tar_stream: Any) -> None:
        await self._run_root(["mkdir", "-p", remote_dir], f"creating {remote_dir}")

        def put() -> bool:
            try:
                return bool(client().api.put_archive(self.container_id, remote_dir, tar_stream))
            finally:
                tar_stream.close()

        try:
            ok = await asyncio.to_thread(put)
        except docker.errors.APIError as exc:
            raise FileTransferError(f"copying into {remote_dir} in sandbox {self.id} failed: {exc}") from exc
        if not ok:
            raise FileTransferError(f"docker refused the copy into {remote_dir} in sandbox {self.id}")

    async def _chown_for_default_user(self, remote: str) -> None:
        if self.spec.user:
            await self._run_root(["chown", "-R", self.spec.user, remote], f"giving {remote} to {self.spec.user}")

    async def _upload_file(self, local_path: Path, remote_path: str) -> None:
        parent, name = posixpath.split(remote_path)
        tar_stream = await asyncio.to_thread(tar_single_file, local_path, name)
        await self._put_tar(parent or "/", tar_stream)
        await self._chown_for_default_user(remote_path)

    async def _upload_dir(self, local_dir: Path, remote_dir: str) -> None:
        tar_stream = await asyncio.to_thread(tar_directory, local_dir)
        await self._put_tar(remote_dir, tar_stream)
        await self._chown_for_default_user(remote_dir)

    def _get_archive(self, remote: str) -> Iterator[bytes]:
        try:
            stream, _stat = client().api.get_archive(self.container_id, remote, chunk_size=1024 * 1024)
        except docker.errors.NotFound as exc:
            raise FileTransferError(f"{remote} does not exist in sandbox {self.id}") from exc
        except docker.errors.APIError as exc:
            raise FileTransferError(f"copying {remote} out of sandbox {self.id} failed: {exc}") from exc
        return stream  # type: ignore[no-any-return]

    async def _download_file(self, remote_path: str, local_path: Path) -> None:
        def fetch() -> None:
            extract_single_file(IterStream(self._get_archive(remote_path)), local_path)  # type: ignore[arg-type]

        await asyncio.to_thread(fetch)

    async def _download_dir(self, remote_dir: str, local_dir: Path) -> None:
        def fetch() -> None:
            extract_tar(IterStream(self._get_archive(remote_dir.rstrip("/") or "/")), local_dir, strip_top=True)  # type: ignore[arg-type]

        await asyncio.to_thread(fetch)


def _drain(stream: Any, out: list[bytes], err: list[bytes]) -> None:
    try:
        for stdout_chunk, stderr_chunk in stream:
            if stdout_chunk:
                out.append(stdout_chunk)
            if stderr_chunk:
                err.append(stderr_chunk)
    except (OSError, ValueError, AttributeError, requests.exceptions.RequestException):
        pass  # the stream was closed under us after a timeout


def _remove_container(api: Any, name: str) -> None:
    try:
        api.api.remove_container(name, force=True, v=True)
    except docker.errors.NotFound:
        return
    except docker.errors.APIError as exc:
        if exc.status_code == 409 and "already in progress" in str(exc):
            return
        raise


# -- garbage collection hooks (see janitor.collect_garbage) -----------------------------------------


def gc_candidates() -> list[tuple[str, dict[str, str]]]:
    if not engine_available():
        return []
    containers = _retry(client().api.containers)(all=True, filters={"label": janitor.OWNER_LABEL})
    return [(str(c["Id"])[:12], dict(c.get("Labels") or {})) for c in containers]


def gc_remove(ref: str) -> None:
    _retry(_remove_container)(client(), ref)
