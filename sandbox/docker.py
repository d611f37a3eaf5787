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
import re
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

import requests.exceptions
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential

from . import janitor
from ._disk import is_mounted
from ._procid import EXEC_DIR, KILL_ALL, KILL_RECORDED, RECORD_AND_EXEC, RELAY_RECORD, START_FN
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
    filter_tar,
)
from .spec import SandboxSpec, format_size, parse_size
from .tunnel import Tunnel, TunnelError, docker_exec_channel

# The SDK is imported by name at run time: the repository's own docker/ directory (Dockerfiles)
# would otherwise shadow it for type checkers.
docker: Any = importlib.import_module("docker")
importlib.import_module("docker.errors")
importlib.import_module("docker.types")

T = TypeVar("T")

BUILD_TAG_PREFIX = "ares-gateway/sandbox-build"
_API_TIMEOUT = 120

#: The PATH of every command run as root: system directories only, whatever the image, the spec or
#: the caller put on it.  The agent may write its home (~/.local/bin, ~/.npm-global/bin): a program it
#: plants there must never be found by root.
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_ROOT_ENV = {"PATH": SYSTEM_PATH, "HOME": "/root"}
# What a root command never gets, from the image, the spec or the caller: what makes an interpreter
# or the dynamic loader run code from elsewhere (PYTHON*: no PYTHONPATH, PYTHONSTARTUP, user site
# redirection; LD_*), what a shell reads on start (BASH_ENV, ENV) or cd follows (CDPATH), and where
# node, npm, perl, ruby, git and XDG tools look for code or configuration (the image's
# NPM_CONFIG_PREFIX points into the agent's home).  A verifier that needs one sets it in test.sh.
_UNSAFE_FOR_ROOT = re.compile(
    r"PYTHON\w*|LD_\w+|BASH_ENV|ENV|CDPATH|NODE_OPTIONS|NODE_PATH|NPM_CONFIG_PREFIX|npm_config_prefix|"
    r"PERL5LIB|PERL5OPT|PERLLIB|RUBYLIB|RUBYOPT|GIT_EXEC_PATH|GIT_CONFIG\w*|GIT_TEMPLATE_DIR|XDG_\w+"
)

# Every command runs as root first: the exec itself is root's, and so is the record of the command's
# session leader (``<pid> <start time>``, in the root-only EXEC_DIR), written before it switches to the
# command's user.  A timeout or a cancellation kills by that record, never by a file the agent can
# write (an agent that named the relay's pid in a pid file of its own had root kill the relay).
#
# _OUTER: $1 record file, $2 command, $3 user ('' = root; name, uid, name:group or uid:gid, as
# `docker exec --user`), $4 names unset for root, $5 1 when the caller gave no PATH, $6 RECORD_AND_EXEC,
# $7 _USER_PART.  The caller's environment comes as ARES_UENV_<i>="NAME=value" (set again only where the
# command runs: root's own steps here never see it).  The user is looked up in the image's /etc/passwd
# by builtins; uid 0 under any name is root: SYSTEM_PATH, HOME=/root and the names of $4 unset.  Another
# user is switched to with setpriv (util-linux; runuser where only that exists) and gets, when the
# caller gave no PATH, its own bin directories (~/.local/bin and the npm prefix's) before the image's.
_RESTORE = (
    'i=0; while eval "v=\\${ARES_UENV_$i-}; s=\\${ARES_UENV_$i+x}"; [ -n "$s" ]; do '
    'unset "ARES_UENV_$i"; export "$v"; i=$((i+1)); done; '
)
_USER_PART = (
    'c=$0; PATH=$ARES_UPATH; HOME=$ARES_UHOME; up=$ARES_UP; unset ARES_UPATH ARES_UHOME ARES_UP; '
    'export PATH HOME; '
    + _RESTORE
    + 'if [ "$up" = 1 ]; then for d in "$HOME/.local/bin" "${NPM_CONFIG_PREFIX:+$NPM_CONFIG_PREFIX/bin}"; do '
    'case ":$PATH:" in *":$d:"*) ;; *) [ -n "$d" ] && PATH="$d:$PATH";; esac; done; export PATH; fi; '
    'exec /bin/sh -c "$c"'
)
_OUTER = (
    'p=$1; c=$2; u=$3; un=$4; up=$5; rec=$6; usr=$7; '
    f'opath=${{PATH:-{SYSTEM_PATH}}}; PATH={SYSTEM_PATH}; export PATH; '
    '[ -d "${p%/*}" ] || mkdir -p -m 700 "${p%/*}" || exit 125; '
    'uid=0; gid=0; name=; home=/; g=; '
    'if [ -n "$u" ]; then n=${u%%:*}; case $u in *:*) g=${u#*:};; esac; found=; '
    'while IFS=: read -r pn _ pu pg _ ph _; do '
    'case $n in *[!0-9]*) [ "$pn" = "$n" ];; *) [ "$pu" = "$n" ];; esac && { found=1; name=$pn; uid=$pu; '
    'gid=$pg; home=$ph; break; }; done </etc/passwd; '
    'if [ -z "$found" ]; then case $n in ""|*[!0-9]*) '
    'echo "ares-exec: unable to find user $n: no matching entries in passwd file" >&2; exit 126;; esac; '
    'uid=$n; fi; if [ -n "$g" ]; then case $g in *[!0-9]*) gg=; '
    'while IFS=: read -r gn _ gi _; do [ "$gn" = "$g" ] && { gg=$gi; break; }; done </etc/group; '
    '[ -n "$gg" ] || { echo "ares-exec: unable to find group $g" >&2; exit 126; }; gid=$gg;; *) gid=$g;; '
    'esac; fi; fi; if [ "$uid" = 0 ]; then '
    + _RESTORE
    + f'PATH={SYSTEM_PATH}; HOME=/root; export PATH HOME; for n in $un; do unset "$n"; done; set -- '
      '/bin/sh -c "$c"; '
    'else ARES_UPATH=$opath; ARES_UHOME=$home; ARES_UP=$up; export ARES_UPATH ARES_UHOME ARES_UP; '
    'if command -v setpriv >/dev/null 2>&1; then '
    'if [ -n "$name" ]; then set -- --init-groups; else set -- --clear-groups; fi; '
    'set -- setpriv --reuid="$uid" --regid="$gid" "$@" -- /bin/sh -c "$usr" "$c"; '
    'elif [ -n "$name" ] && command -v runuser >/dev/null 2>&1; then '
    'if [ -n "$g" ]; then set -- -g "$g"; else set --; fi; set -- runuser -u "$name" "$@" -- /bin/sh -c '
    '"$usr" "$c"; else echo "ares-exec: running a command as $u needs setpriv or runuser (util-linux) in the '
    'image" >&2; exit 126; fi; fi; '
    'if command -v setsid >/dev/null 2>&1; then setsid -w /bin/sh -c "$rec" "$p" "$@"; rc=$?; '
    'else /bin/sh -c "$rec" "$p" "$@"; rc=$?; fi; rm -f "$p"; exit $rc'
)
_KILL = KILL_RECORDED

# Root-owned directory of the sandbox's own machinery: the relay script, its pid files and logs, and
# the read-only mounts of host socket directories (/.ares/forward/<n>).
_ARES_DIR = "/.ares"
_RELAY_SCRIPT = Path(__file__).with_name("_relay.py")
# $1 port, $2 socket path inside.  Starts the relay detached, waits for its pid (ready) file and
# records it as root's (/.ares/relay-$port.id: pid and start time, checked by kill_processes()).
_START_RELAY = START_FN + r"""
port=$1; sock=$2; r=/.ares/relay-$port.pid; id=/.ares/relay-$port.id; log=/.ares/relay-$port.log
command -v python3 >/dev/null 2>&1 || { echo "the image has no python3, which the relay needs"; exit 3; }
rm -f "$r" "$id"
setsid python3 -I /.ares/relay.py --listen "127.0.0.1:$port" --unix "$sock" --ready-file "$r" >"$log" 2>&1 </dev/null &
i=0; while [ ! -f "$r" ] && [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); done
[ -f "$r" ] || { cat "$log"; exit 4; }
p=; read -r p <"$r"; l=; read -r l <"/proc/$p/stat" || { cat "$log"; exit 4; }
_ares_start "$l"; echo "$p $t" >"$id.tmp" && mv -f "$id.tmp" "$id"
"""  # noqa: E501 (an embedded script, kept as it runs)
# $1 port, $2 max streams.  The relay of the exec tunnel, on the exec's stdin/stdout.  Docker does not
# always end a dropped exec (its stdout stuck): a relay of this port left from an earlier channel is
# killed first (only while its record still names that very process), freeing the port.
_TUNNEL_RELAY = f'PATH={SYSTEM_PATH}; export PATH; port=$1; d=/.ares; ' + RELAY_RECORD + (
    'exec python3 -I /.ares/relay.py --listen "127.0.0.1:$port" --tunnel binary '
    '--ready-file "$d/relay-$port.pid" --max-connections "$2"'
)


# What limits_reached() reads inside the container (as root, builtins but df) where the host's view
# of the container's cgroup is not at hand (a remote engine): the container's own cgroup counters
# (v1: a hierarchy per controller; v2: one) and the writable layer's free space.
_LIMITS_CGROUP = r"""
for f in /sys/fs/cgroup/memory/memory.oom_control /sys/fs/cgroup/memory.events \
         /sys/fs/cgroup/pids/pids.events /sys/fs/cgroup/pids.events; do
  [ -r "$f" ] && while read -r k v; do echo "cg $k $v"; done <"$f"
done
true
"""
_LIMITS_DF = r"""
df -Pk / 2>/dev/null | { read -r _; read -r _ size _ avail _ && echo "blocks $size $avail"; }
df -Pi / 2>/dev/null | { read -r _; read -r _ size _ avail _ && echo "inodes $size $avail"; }
true
"""
#: Processes root may add above the pids limit while kill_processes() runs, so that it can still
#: start (a docker exec is a process of the container) when the agent has taken every pid.
_KILL_PIDS_HEADROOM = 32
_SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Prints "<pid> <start time>" of the container's keeper (`sleep infinity`, the first child of its init).
_KEEPER_RECORD = START_FN + (
    'i=0; k=; while :; do read -r k </proc/1/task/1/children; [ -n "$k" ] && break; i=$((i+1)); '
    '[ $i -gt 250 ] && exit 3; sleep 0.02; done; set -- $k; l=; read -r l <"/proc/$1/stat" || exit 3; '
    '_ares_start "$l"; echo "$1 $t"'
)
#: The pids limit of a sandbox whose spec sets none: far above what an agent, its tools and a test
#: suite use, far below the host's pid_max (32768 by default), so a fork bomb stays inside.
DEFAULT_PIDS = 4096
#: The memory limit (no swap beyond it) of a sandbox whose spec sets none.
DEFAULT_MEMORY = "8g"


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
    """One container per sandbox.

    Limits: ``spec.resources`` (else ``default_memory`` and ``default_pids``; ``None`` turns a default
    off) become the container's cgroup limits: ``mem_limit`` with ``memswap_limit`` equal (no swap
    beyond it), ``pids_limit``, ``nano_cpus``.  ``disk`` limits the container's whole writable layer:
    on a local overlay2 engine (run as root) the layer is a loop-mounted ext4 file system of that size,
    made sparse in ``disk_image_dir`` (default: the system's temp directory) and gone with the
    container; elsewhere the engine's ``storage_opt`` size (overlay2 on xfs with pquota, btrfs, zfs),
    and a clear error where the engine can do neither.  :meth:`limits_reached` reports what was hit.
    """

    backend = "docker"

    def __init__(
        self,
        spec: SandboxSpec | None = None,
        *,
        pull: bool = False,
        default_memory: int | str | None = DEFAULT_MEMORY,
        default_pids: int | None = DEFAULT_PIDS,
        disk_image_dir: str | None = None,
        tunnel: str | None = None,
        tunnel_max_streams: int = 256,
    ) -> None:
        super().__init__(spec)
        # ARES_DOCKER_TUNNEL reaches sandboxes that runs and episodes create (`ares-gateway run --tunnel`).
        tunnel = tunnel or os.environ.get("ARES_DOCKER_TUNNEL") or "mount"
        if tunnel not in ("mount", "exec"):
            raise ValueError("tunnel must be 'mount' (a bind-mounted socket) or 'exec' (over docker exec), "
                             f"got {tunnel!r}")
        self.pull = pull
        self.container_id: str | None = None
        self.image: str | None = None
        self._container_name = f"ares-sbx-{self.id}"
        #: How forward() reaches a host socket: "mount" (its directory bind-mounted, a relay inside
        #: connects to it) or "exec" (sandbox.tunnel over a long-lived docker exec; nothing mounted).
        self.tunnel = tunnel
        self.tunnel_max_streams = tunnel_max_streams
        self._tunnels: dict[int, Tunnel] = {}
        # Host directory of a forwarded socket -> where it is mounted inside (read-only).
        self._socket_dirs: dict[str, str] = {}
        dirs = sorted({os.path.dirname(p) for p in self.spec.forwards.values()}) if tunnel == "mount" else []
        for n, directory in enumerate(dirs):
            self._socket_dirs[directory] = f"{_ARES_DIR}/forward/{n}"
        self._relay_uploaded = False
        res = self.spec.resources
        if default_pids is not None and default_pids < 1:
            raise ValueError(
                f"default_pids must be a positive number of processes or None, got {default_pids!r}")
        self.memory_limit: int | None = (res.memory_bytes if res.memory is not None
                                         else parse_size(default_memory))
        self.pids_limit: int | None = res.pids if res.pids is not None else default_pids
        self.disk_limit: int | None = res.disk_bytes
        self.disk_image_dir = disk_image_dir or os.environ.get("ARES_DOCKER_DISK_DIR") or None
        #: How the disk limit is enforced once started: "loop" (the writable layer is a file system
        #: of its own), "storage-opt" (the engine's quota), or None (no disk limit).
        self.disk_mode: str | None = None
        #: The host mount point of the writable layer's own file system (disk_mode "loop").
        self.disk_mount: str | None = None
        # Names of the image's environment that root commands never get (see _UNSAFE_FOR_ROOT).
        self._image_unsafe: tuple[str, ...] = ()
        self._image_user = ""
        # "<pid> <start time>" of the container's `sleep infinity`, recorded at start.
        self._keeper_record = ""

    @property
    def description(self) -> str:
        target = self.image or self.spec.image or self.spec.dockerfile
        limits = [
            f"memory {format_size(self.memory_limit)} (no swap)" if self.memory_limit else "memory unlimited",
            f"pids {self.pids_limit}" if self.pids_limit else "pids unlimited",
        ]
        if self.disk_limit is None:
            limits.append("disk unlimited")
        elif self.disk_mode == "storage-opt":
            limits.append(f"disk {format_size(self.disk_limit)} (the engine's quota on the writable layer)")
        else:
            limits.append(f"disk {format_size(self.disk_limit)} (the whole writable layer on a loop-mounted "
                          "ext4; bind mounts and /dev/shm not counted)")
        return (f"docker sandbox {self.id} (container {self._container_name}, image {target}, "
                f"network={self.spec.network}"
                + ("; forwards over an exec tunnel" if self.tunnel == "exec" else "")
                + f"; {', '.join(limits)}; root commands get PATH={SYSTEM_PATH}, "
                "HOME=/root and no PYTHON*/LD_* variables)")

    # -- lifecycle ---------------------------------------------------------------------------------
    async def _start(self) -> None:
        self.image = await asyncio.to_thread(image_for, self.spec, pull=self.pull)
        self._image_user, image_env = await asyncio.to_thread(_image_config, self.image)
        self._image_unsafe = tuple(sorted(n for n in image_env if _UNSAFE_FOR_ROOT.fullmatch(n)))
        self.container_id = await asyncio.to_thread(self._create_container)
        self._keeper_record = await asyncio.to_thread(self._record_keeper)

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
        }
        if self._socket_dirs:
            kwargs["volumes"] = {host: {"bind": inside, "mode": "ro"} for host,
                                 inside in self._socket_dirs.items()}
        if res.cpus:
            kwargs["nano_cpus"] = int(res.cpus * 1e9)
        if self.memory_limit:
            kwargs["mem_limit"] = self.memory_limit
            kwargs["memswap_limit"] = self.memory_limit
        if self.pids_limit:
            kwargs["pids_limit"] = self.pids_limit
        if res.gpus:
            kwargs["device_requests"] = [docker.types.DeviceRequest(count=res.gpus, capabilities=[["gpu"]])]

        @_retry
        def create(extra: dict[str, Any]) -> Any:
            try:
                return api.containers.create(**kwargs, **extra)
            except docker.errors.APIError as exc:
                if exc.status_code == 409:  # an earlier attempt did create it: adopt it
                    return api.containers.get(self._container_name)
                raise

        container = create({})
        if self.disk_limit is not None:
            try:
                loop = _loop_layer(api, container.id, self.disk_limit, self.disk_image_dir)
            except BaseException:
                _retry(_remove_container)(api, container.id)
                raise
            if loop:
                self.disk_mode, self.disk_mount = "loop", loop
            else:  # not a local overlay2 engine we may mount on: the engine's own quota, if it has one
                _retry(_remove_container)(api, container.id)
                try:
                    container = create({"storage_opt": {"size": str(self.disk_limit)}})
                except docker.errors.APIError as exc:
                    raise SandboxStartError(
                        f"cannot limit the disk of sandbox {self.id} to {format_size(self.disk_limit)}: "
                        "the writable layer can be put on a loop-mounted file system only with a local "
                        "overlay2 engine and "
                        "root on its host, and this engine refuses a storage quota "
                        f"({exc.explanation or exc}). "
                        "Run as root next to the engine, use an engine with quotas (overlay2 on xfs with "
                        "pquota), or drop Resources.disk"
                    ) from exc
                self.disk_mode = "storage-opt"
        _retry(container.start)()
        return str(container.id)

    def _record_keeper(self) -> str:
        """The container's keeper as "<pid> <start time>", taken before any command of the agent ran:
        kill_processes() spares it only while /proc still shows that very process."""
        code, out = self._root_exec_sync(["/bin/sh", "-c", _KEEPER_RECORD])
        record = out.decode(errors="replace").strip()
        if code != 0 or len(record.split()) != 2 or not all(f.isdigit() for f in record.split()):
            raise SandboxStartError(
                f"sandbox {self.id}: cannot find the container's keeper process ({record[-200:]!r})")
        return record

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
        pidfile = f"{EXEC_DIR}/{uuid.uuid4().hex}.pid"
        # Names root never gets: the wrapper unsets them when the command runs as uid 0 (whatever the name).
        unsafe = " ".join(sorted({*self._image_unsafe, *(k for k in env if _UNSAFE_FOR_ROOT.fullmatch(k))}))
        if self._runs_as_root(user):
            env = {**{k: v for k, v in env.items() if not _UNSAFE_FOR_ROOT.fullmatch(k)}, **_ROOT_ENV}
        for key in env:
            if not _SHELL_NAME.fullmatch(key):
                raise ExecError(
                    f"environment variable name {key!r} cannot be passed to a docker command: use "
                    "letters, digits and underscores (not starting with a digit)")
        # The exec is root's; the caller's environment rides along as carriers, set again only where
        # the command runs (as its user), so root's own steps in the wrapper never run with it.
        carriers = {f"ARES_UENV_{i}": f"{k}={v}" for i, (k, v) in enumerate(env.items())}
        argv = ["/bin/sh", "-c", _OUTER, "ares-exec", pidfile, command, user or self._image_user, unsafe,
                "0" if "PATH" in env else "1", RECORD_AND_EXEC, _USER_PART]
        api = client().api
        started = time.monotonic()
        exec_id = await asyncio.to_thread(self._exec_create, api, argv, cwd, carriers)
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
            raise ExecError(
                f"docker could not run the command in sandbox {self.id}: {(stdout + stderr).strip()}")
        if code in (125, 126) and stderr.startswith("ares-exec: "):
            raise ExecError(f"docker could not run the command in sandbox {self.id}: {stderr.strip()[11:]}")
        return ExecResult(
            stdout=stdout,
            stderr=stderr,
            exit_code=-9 if timed_out else (code if code is not None else -1),
            timed_out=timed_out,
            duration=time.monotonic() - started,
        )

    def _exec_create(self, api: Any, argv: list[str], cwd: str, env: dict[str, str]) -> str:
        try:
            res = api.exec_create(
                self.container_id, argv, stdout=True, stderr=True, stdin=False, tty=False,
                environment=env, workdir=cwd, user="root",
            )
        except docker.errors.NotFound as exc:
            raise ExecError(f"container of sandbox {self.id} is gone ({exc}); create a new sandbox") from exc
        except docker.errors.APIError as exc:
            raise ExecError(f"docker exec in sandbox {self.id} failed: {exc}") from exc
        return str(res["Id"])

    def _runs_as_root(self, user: str | None) -> bool:
        """Whether ``user`` (``None``: the image's) is root by name or uid; the exec wrapper also checks
        the real uid, so a root under another name is cleaned up there."""
        name = (user or self._image_user or "root").split(":", 1)[0]
        return name in ("root", "0", "")

    def _root_exec_sync(self, argv: list[str]) -> tuple[int, bytes]:
        """One of the backend's own root steps: the system PATH and HOME=/root, the output whole."""
        api = client().api
        exec_id = api.exec_create(self.container_id, argv, user="root", environment=_ROOT_ENV,
                                  workdir="/")["Id"]
        output = api.exec_start(exec_id)
        code = api.exec_inspect(exec_id).get("ExitCode")
        return (code if code is not None else -1), output

    def _kill_group(self, pidfile: str) -> None:
        with contextlib.suppress(docker.errors.DockerException, requests.exceptions.RequestException):
            self._root_exec_sync(["/bin/sh", "-c", _KILL, pidfile])

    # -- forwarding and killing -------------------------------------------------------------------
    async def _forward(self, port: int, host_socket: str) -> None:
        if self.tunnel == "exec":
            await self._forward_exec(port, host_socket)
            return
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
        r = await self._exec(
            command_to_shell(["sh", "-c", _START_RELAY, "ares-relay", str(port), f"{inside}/{name}"]),
            user="root", cwd="/", env={}, timeout=60)
        if not r.ok:
            raise ForwardError(f"the relay for port {port} of sandbox {self.id} did not start: "
                               f"{(r.stdout + r.stderr).strip()[-500:] or f'exit {r.exit_code}'}")

    async def _forward_exec(self, port: int, host_socket: str) -> None:
        """A relay in tunnel mode on a root exec that stays attached; its pid file spares it in
        kill_processes().  Another exec replaces it when the attach drops (see sandbox.tunnel)."""
        assert self.container_id is not None
        if not self._relay_uploaded:
            await asyncio.to_thread(self._upload_relay)
            self._relay_uploaded = True
        code, _ = await asyncio.to_thread(self._root_exec_sync, ["/bin/sh", "-c", "command -v python3"])
        if code != 0:
            raise ForwardError(
                f"the image of sandbox {self.id} has no python3, which the exec tunnel's relay needs: "
                "use tunnel='mount' or an image with python3")
        argv = ["/bin/sh", "-c", _TUNNEL_RELAY, "ares-relay", str(port), str(self.tunnel_max_streams)]
        container = self.container_id
        tunnel = Tunnel(lambda: docker_exec_channel(container, argv), host_socket,
                        max_streams=self.tunnel_max_streams)
        try:
            await tunnel.start()
        except (TunnelError, OSError, docker.errors.DockerException) as exc:
            raise ForwardError(
                f"the exec tunnel for port {port} of sandbox {self.id} did not start: {exc}") from exc
        self._tunnels[port] = tunnel

    def tunnel_for(self, port: int) -> Tunnel | None:
        """The exec tunnel serving ``port`` (``tunnel="exec"``), for its counters and tests."""
        return self._tunnels.get(port)

    async def _stop(self) -> None:
        tunnels, self._tunnels = list(self._tunnels.values()), {}
        for tunnel in tunnels:
            await tunnel.close()
        await super()._stop()

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
        self._root_exec_sync(["/bin/mkdir", "-p", "-m", "755", _ARES_DIR])
        if not api.put_archive(self.container_id, _ARES_DIR, buf.getvalue()):
            raise ForwardError(f"docker refused the relay script's copy into sandbox {self.id}")

    async def _kill_processes(self, user: str | None, timeout: float) -> int:
        if not self.pids_limit:
            return await self._kill_all(user, timeout)
        # An agent that took every pid would keep root's exec from starting: lift the limit a little
        # while its processes are killed (each round kills what forked in the meantime).
        await asyncio.to_thread(self._set_pids_limit, self.pids_limit + _KILL_PIDS_HEADROOM)
        try:
            return await self._kill_all(user, timeout)
        finally:
            await asyncio.to_thread(self._set_pids_limit, self.pids_limit)

    def _set_pids_limit(self, limit: int) -> None:
        # The SDK's update_container() predates PidsLimit; the engine's API has it (1.40+).
        api = client().api
        url = f"{api.base_url}/v{api.api_version}/containers/{self.container_id}/update"
        try:
            reply = _retry(api.post)(url, json={"PidsLimit": limit}, timeout=_API_TIMEOUT)
            reply.raise_for_status()
        except (requests.exceptions.RequestException, docker.errors.DockerException) as exc:
            raise ExecError(f"setting the pids limit of sandbox {self.id} to {limit} failed: {exc}") from exc

    async def _kill_all(self, user: str | None, timeout: float) -> int:
        uid = ""
        if user is not None:
            if user.isdigit():
                uid = user
            else:
                r = await self._exec(command_to_shell(["id", "-u", user]), user="root", cwd="/", env={},
                                     timeout=30)
                if not r.ok:
                    raise ExecError(f"no user {user!r} in sandbox {self.id}: {r.stderr.strip()}")
                uid = r.stdout.strip()
        rounds = max(1, int(timeout / 0.05))
        r = await self._exec(command_to_shell(["sh", "-c", KILL_ALL, "ares-kill", uid, str(rounds),
                                               self._keeper_record]), user="root",
                             cwd="/", env={}, timeout=timeout + 30)
        out = r.stdout.strip()
        if not r.ok or not out.isdigit():
            raise ExecError(
                f"killing the processes of sandbox {self.id} failed: {(out + r.stderr).strip()[-500:]}")
        return int(out)

    async def _limits_reached(self) -> frozenset[str]:
        assert self.container_id is not None
        # The host's view of the container's cgroup first: it needs no process in the container,
        # which a container that used up its pids could not start.
        out = await asyncio.to_thread(_host_cgroup_counters, self.container_id)
        if out is None:
            r = await self._exec(_LIMITS_CGROUP, user="root", cwd="/", env={}, timeout=30)
            if not r.ok:  # the container is gone or stopped: what the engine kept
                state = await asyncio.to_thread(
                    lambda: client().api.inspect_container(self.container_id)["State"])
                return frozenset({"memory"} if self.memory_limit and state.get("OOMKilled") else ())
            out = r.stdout
        if self.disk_mode == "loop" and self.disk_mount:
            st = await asyncio.to_thread(os.statvfs, self.disk_mount)
            out += (f"\nblocks {st.f_blocks * st.f_frsize // 1024} {st.f_bavail * st.f_frsize // 1024}"
                    f"\ninodes {st.f_files} {st.f_favail}\n")
        elif self.disk_mode is not None:
            with contextlib.suppress(Exception):
                out += "\n" + (await self._exec(_LIMITS_DF, user="root", cwd="/", env={}, timeout=30)).stdout
        return _parse_limits(out, memory=bool(self.memory_limit), pids=bool(self.pids_limit),
                             disk=self.disk_limit)

    async def _run_root(self, argv: list[str], what: str) -> None:
        assert self.container_id is not None

        code, output = await asyncio.to_thread(self._root_exec_sync, argv)
        if code != 0:
            raise FileTransferError(
                f"{what} in sandbox {self.id} failed: {output.decode(errors='replace').strip()}")

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

    async def _uploaded(self, remote: str) -> None:
        if self.spec.user:
            await self._run_root(["chown", "-R", self.spec.user, remote],
                                 f"giving {remote} to {self.spec.user}")

    def _get_archive(self, remote: str) -> Iterator[bytes]:
        try:
            stream, _stat = client().api.get_archive(self.container_id, remote, chunk_size=1024 * 1024)
        except docker.errors.NotFound as exc:
            raise FileTransferError(f"{remote} does not exist in sandbox {self.id}") from exc
        except docker.errors.APIError as exc:
            raise FileTransferError(f"copying {remote} out of sandbox {self.id} failed: {exc}") from exc
        return stream  # type: ignore[no-any-return]

    async def _get_tar(self, directory: str, name: str) -> IO[bytes]:
        # The engine's archive of the path: a directory under its own name (stripped by the caller).
        path = directory if name == "." else posixpath.join(directory, name)
        return IterStream(await asyncio.to_thread(self._get_archive, path))  # type: ignore[return-value]

    async def _archive_dir(self, remote_dir: str, local_path: Path, limit: int) -> int:
        # The engine's own archive of the directory (made outside every process of the container,
        # links stored as links), filtered as it streams in.
        def fetch() -> int:
            stream = self._get_archive(remote_dir.rstrip("/") or "/")
            try:
                with open(local_path, "wb") as out:
                    return filter_tar(IterStream(stream), out, limit=limit, strip_top=True)  # type: ignore[arg-type]
            finally:
                close = getattr(stream, "close", None)
                if close is not None:
                    close()

        return await asyncio.to_thread(fetch)


@_retry
def _image_config(image: str) -> tuple[str, list[str]]:
    """The image's default user and the names of its environment variables."""
    config = client().api.inspect_image(image).get("Config") or {}
    return str(config.get("User") or ""), [str(e).split("=", 1)[0] for e in config.get("Env") or []]


def _parse_limits(out: str, *, memory: bool, pids: bool, disk: int | None) -> frozenset[str]:
    """The limits hit, from the output of _LIMITS_CGROUP and _LIMITS_DF: cgroup counters that count
    kills and refusals (``oom_kill``, pids ``max``); the disk as full when the writable layer has less
    than about 2 % (at most 4 MiB) or no inode left, which is what a refused write leaves."""
    hit: set[str] = set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "cg" and parts[2].isdigit() and int(parts[2]) > 0:
            if parts[1] == "oom_kill" and memory:
                hit.add("memory")
            elif parts[1] == "max" and pids:
                hit.add("pids")
        elif len(parts) == 3 and parts[0] in ("blocks", "inodes") and disk is not None:
            if not (parts[1].isdigit() and parts[2].isdigit()):
                continue
            size, avail = int(parts[1]), int(parts[2])
            if parts[0] == "blocks" and size > 0 and avail < min(4096, max(64, size // 50)):
                hit.add("disk")
            elif parts[0] == "inodes" and size > 0 and avail == 0:
                hit.add("disk")
    return frozenset(hit)


def _host_cgroup_counters(container_id: str) -> str | None:
    """The container's cgroup counters as _LIMITS_CGROUP prints them, read on the host through its
    init's /proc/<pid>/cgroup (v1 or v2); None where the engine's processes are not this host's."""
    state = client().api.inspect_container(container_id).get("State") or {}
    pid = state.get("Pid") or 0
    if not state.get("Running") or not pid:
        return None
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    if not any(container_id in line for line in lines):  # another host's pid of that number
        return None
    files: list[str] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "memory":
            files.append(f"/sys/fs/cgroup/memory{path}/memory.oom_control")
        elif controllers == "pids":
            files.append(f"/sys/fs/cgroup/pids{path}/pids.events")
        elif controllers == "" and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):  # v2 only
            files += [f"/sys/fs/cgroup{path}/memory.events", f"/sys/fs/cgroup{path}/pids.events"]
    out = []
    for name in files:
        with contextlib.suppress(OSError), open(name, encoding="utf-8") as f:
            out += [f"cg {line}" for line in f.read().splitlines()]
    return "\n".join(out) + "\n" if files else None


def _loop_layer(api: Any, container_id: str, size: int, image_dir: str | None) -> str | None:
    """Put a created (not yet started) container's writable layer on an ext4 file system of ``size``
    bytes of its own: a sparse file, loop-mounted over the overlay2 layer directory (its ``diff`` and
    ``work`` copied in), so every write of the container, whatever the path, fills that file system
    and no more.  The file is unlinked once mounted: the loop device (autoclear) goes with the mount,
    which the engine's own removal of the layer unmounts.  Returns the mount point; None where it cannot
    be done here (another storage driver, a remote engine, not root, no mkfs.ext4)."""
    driver = api.api.inspect_container(container_id).get("GraphDriver") or {}
    upper = (driver.get("Data") or {}).get("UpperDir") or ""
    tools = [shutil.which(t) for t in ("mkfs.ext4", "mount")]
    if driver.get("Name") != "overlay2" or not upper or os.geteuid() != 0 or None in tools:
        return None
    layer = os.path.dirname(upper)
    if not os.path.isdir(upper) or not os.path.isfile(os.path.join(layer, "lower")):
        return None
    if is_mounted(layer):  # adopted from an earlier attempt that got this far
        return layer
    mkfs, mount = str(tools[0]), str(tools[1])
    fd, img = tempfile.mkstemp(prefix="ares-disk-", suffix=".img", dir=image_dir)
    try:
        os.ftruncate(fd, size)
        os.close(fd)
        fd = -1
        # -d: the layer directory's entries (diff, work, link, lower) become the new file system's;
        # no journal, no reserved blocks: a scratch file system that lives as long as the container.
        for argv in ([mkfs, "-q", "-F", "-m", "0", "-O", "^has_journal", "-E", "nodiscard", "-d", layer, img],
                     [mount, "-o", "loop", img, layer]):
            done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
            if done.returncode != 0:
                raise SandboxStartError(
                    f"limiting the disk to {format_size(size)} failed: {' '.join(argv[:1])} says "
                    f"{(done.stderr or done.stdout).strip()[-400:]} (set ARES_DOCKER_DISK_DIR to a directory "
                    "on a file system with room for the sparse image, or drop Resources.disk)"
                )
    finally:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(img)
    return layer


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
