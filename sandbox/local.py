"""``LocalSandbox``: the embedded default, needs no service.

Each sandbox gets a private directory (``$ARES_SANDBOX_LOCAL_ROOT`` or ``/tmp/ares-sandboxes``, then
the sandbox id) holding its workspace and its ``/tmp``.  Commands run in their own session and process
group with an environment scrubbed to what the spec passes (plus ``PATH`` and ``HOME`` defaults and
``ARES_SANDBOX_ID``, by which leftover processes are found and killed).

When bubblewrap (``bwrap``) is installed and works, commands run inside it: the host filesystem
read-only, the workspace bind-mounted read-write at the spec's ``workdir``, a private ``/tmp``, fresh
``/dev`` and ``/proc`` and a private PID namespace (``network="none"`` also unshares the network).
Without it there is NO isolation, only a private working directory, and :attr:`description` says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import posixpath
import pwd
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path

from . import janitor
from .errors import ExecError, FileTransferError, SandboxStartError
from .protocol import BaseSandbox, ExecResult
from .spec import SandboxSpec

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_ID_VAR = "ARES_SANDBOX_ID"
_OWNER_FILE = "owner.json"


def local_root() -> Path:
    return Path(os.environ.get("ARES_SANDBOX_LOCAL_ROOT") or "/tmp/ares-sandboxes")


@cache
def bwrap_available() -> bool:
    """Whether bubblewrap is installed *and* can create the namespaces it needs here."""
    exe = shutil.which("bwrap")
    if not exe:
        return False
    try:
        probe = subprocess.run(
            [exe, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-pid",
             "--die-with-parent", "true"],
            capture_output=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def _kill_tagged_processes(sandbox_id: str) -> int:
    """SIGKILL every process whose environment carries ``ARES_SANDBOX_ID=<sandbox_id>``."""
    needle = f"{_ID_VAR}={sandbox_id}".encode()
    killed = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        if pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                environ = fh.read()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
    return killed


class LocalSandbox(BaseSandbox):
    backend = "local"

    def __init__(self, spec: SandboxSpec | None = None, *, isolate: bool | None = None) -> None:
        super().__init__(spec)
        self.isolated = bwrap_available() if isolate is None else isolate
        if self.isolated and not bwrap_available():
            raise SandboxStartError("isolate=True needs bubblewrap: apt-get install bubblewrap (and user namespaces)")
        self.root = local_root() / self.id
        self._pgids: set[int] = set()
        # With bubblewrap and root: one long-lived PID/mount namespace per sandbox (a "keeper"), which
        # commands join with nsenter, so that processes a command leaves in the background survive it.
        self._keeper: subprocess.Popen[bytes] | None = None
        self._ns_pid: int | None = None

    @property
    def description(self) -> str:
        if self.isolated:
            return (
                f"local sandbox {self.id} in {self.root} (bubblewrap: read-only host filesystem, private "
                f"{self.spec.workdir} and /tmp, PID namespace, network={self.spec.network})"
            )
        return (
            f"local sandbox {self.id} in {self.root} WITHOUT ISOLATION (bubblewrap not available): commands "
            "run as host processes with a private working directory and a scrubbed environment only"
        )

    @property
    def workdir(self) -> str:
        return self.spec.workdir if self.isolated else str(self.root / "work")

    # -- paths -------------------------------------------------------------------------------------
    def _host_path(self, remote: str) -> Path:
        """Where a path inside the sandbox lives on the host."""
        remote = posixpath.normpath(remote)
        work_roots = {self.spec.workdir, str(self.root / "work")}
        for base in work_roots:
            if remote == base or remote.startswith(base.rstrip("/") + "/"):
                rel = posixpath.relpath(remote, base)
                return (self.root / "work" / rel).resolve() if rel != "." else self.root / "work"
        if self.isolated and (remote == "/tmp" or remote.startswith("/tmp/")):
            return self.root / "tmp" / posixpath.relpath(remote, "/tmp")
        return Path(remote)

    # -- lifecycle -------------------------------------------------------------------------------
    async def _start(self) -> None:
        try:
            (self.root / "work").mkdir(parents=True, exist_ok=False)
            (self.root / "tmp").mkdir(mode=0o1777)
            os.chmod(self.root / "tmp", 0o1777)
            (self.root / _OWNER_FILE).write_text(json.dumps({"id": self.id, "labels": self.labels()}))
        except OSError as exc:
            raise SandboxStartError(
                f"cannot create the local sandbox directory {self.root}: {exc}; set ARES_SANDBOX_LOCAL_ROOT "
                "to a writable directory"
            ) from exc
        if self.spec.network not in ("host", "none"):
            raise SandboxStartError(f"the local backend supports network 'host' or 'none', not {self.spec.network!r}")
        if self.spec.network == "none" and not self.isolated:
            raise SandboxStartError("network='none' needs bubblewrap for the local backend: apt-get install bubblewrap")
        if self.isolated and os.geteuid() == 0 and shutil.which("nsenter"):
            # Spawned from the loop's own thread: bwrap --die-with-parent ties the namespace to it.
            self._start_keeper()

    def _start_keeper(self) -> None:
        argv = [*self._bwrap_prefix(), "--", "sleep", "infinity"]
        self._keeper = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            env={"PATH": DEFAULT_PATH, _ID_VAR: self.id}, start_new_session=True, cwd=str(self.root),
        )
        deadline = time.monotonic() + 10
        children = Path(f"/proc/{self._keeper.pid}/task/{self._keeper.pid}/children")
        while time.monotonic() < deadline:
            if self._keeper.poll() is not None:
                err = self._keeper.stderr.read().decode(errors="replace") if self._keeper.stderr else ""
                raise SandboxStartError(f"bubblewrap failed to start the sandbox namespace: {err.strip()}")
            try:
                pids = children.read_text().split()
            except OSError:
                pids = []
            if pids:  # the namespace's init; its child (sleep) has the sandbox's final root
                inner = Path(f"/proc/{pids[0]}/task/{pids[0]}/children")
                with contextlib.suppress(OSError):
                    grandchildren = inner.read_text().split()
                    if grandchildren:
                        self._ns_pid = int(grandchildren[0])
                        return
            time.sleep(0.01)
        raise SandboxStartError("bubblewrap did not start the sandbox namespace within 10 s")

    def _remove_sync(self) -> None:
        if self._keeper is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._keeper.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                self._keeper.wait(5)
        for pgid in list(self._pgids):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        self._pgids.clear()
        _kill_tagged_processes(self.id)
        shutil.rmtree(self.root, ignore_errors=True)

    # -- exec ----------------------------------------------------------------------------------------
    def _argv(self, command: str, cwd: str, user: str | None) -> list[str]:
        inner = ["/bin/sh", "-c", command]
        if not self.isolated:
            return inner
        switch: list[str] = []
        if user is not None:
            info = self._lookup_user(user)
            switch = ["setpriv", f"--reuid={info.pw_uid}", f"--regid={info.pw_gid}", "--init-groups"]
        if self._ns_pid is not None:
            # Join the sandbox's namespaces; cd inside (nsenter's --wd resolves outside the new root).
            return [
                "nsenter", "-t", str(self._ns_pid), "-m", "-p", "-i", "-u", "-r",
                *(["-n"] if self.spec.network == "none" else []),
                *switch, "sh", "-c", 'cd "$0" || exit 201; exec /bin/sh -c "$1"', cwd, command,
            ]
        return [*self._bwrap_prefix(), "--chdir", cwd, *switch, *inner]

    def _bwrap_prefix(self) -> list[str]:
        argv = [
            "bwrap", *_root_binds(self.spec.workdir), "--dev", "/dev", "--proc", "/proc",
            "--bind", str(self.root / "tmp"), "/tmp",
            "--bind", str(self.root / "work"), self.spec.workdir,
            "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent", "--new-session",
        ]
        if self.spec.network == "none":
            argv.append("--unshare-net")
        return argv

    def _lookup_user(self, user: str) -> pwd.struct_passwd:
        try:
            return pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
        except KeyError as exc:
            raise ExecError(f"no user {user!r} on this host: the local backend runs commands as host users") from exc

    async def _exec(
        self, command: str, *, cwd: str, env: dict[str, str], user: str | None, timeout: float | None
    ) -> ExecResult:
        full_env = {"PATH": DEFAULT_PATH, "HOME": self.workdir, **env, _ID_VAR: self.id}
        host_cwd = self._host_path(cwd)
        if not host_cwd.is_dir():
            raise ExecError(f"cwd {cwd!r} does not exist in sandbox {self.id}: create it first (mkdir -p)")
        kwargs: dict[str, object] = {}
        if user is not None:
            info = self._lookup_user(user)
            if not self.isolated:
                if os.geteuid() != 0 and info.pw_uid != os.geteuid():
                    raise ExecError(f"cannot run as {user!r}: the local backend needs root to switch users")
                if info.pw_uid != os.geteuid():
                    kwargs.update(user=info.pw_uid, group=info.pw_gid, extra_groups=[])
            elif os.geteuid() != 0 and info.pw_uid != os.geteuid():
                raise ExecError(f"cannot run as {user!r}: the local backend needs root to switch users")
        argv = self._argv(command, cwd, user)
        started = time.monotonic()
        try:
            # Not asyncio.create_subprocess_exec: under uvloop the child inherits the parent's fds and
            # uvloop's own copies of its stdio pipes (no close_fds), so a process the command leaves in the
            # background (a detached agent) holds the exec's stdout open and the exec never returns.
            proc = _Process(argv, cwd=str(host_cwd) if not self.isolated else str(self.root), env=full_env,
                            popen_kwargs=kwargs)
        except OSError as exc:
            raise ExecError(f"cannot start {argv[0]}: {exc}") from exc
        self._pgids.add(proc.pid)
        timed_out = False
        try:
            out, err = await proc.communicate(timeout)
        except TimeoutError:
            timed_out = True
            proc.kill_group()
            try:
                out, err = await proc.communicate(5)
            except TimeoutError:  # a process that left the group still holds the pipes
                out, err = proc.abandon()
        except asyncio.CancelledError:
            proc.kill_group()
            proc.abandon()
            raise
        finally:
            # The shell may have left background jobs in its group; they live until stop().
            if proc.returncode is not None and not _group_alive(proc.pid):
                self._pgids.discard(proc.pid)
        code = proc.returncode if proc.returncode is not None else -9
        return ExecResult(
            stdout=out.decode("utf-8", "replace"),
            stderr=err.decode("utf-8", "replace"),
            exit_code=-9 if timed_out else code,
            timed_out=timed_out,
            duration=time.monotonic() - started,
        )

    # -- files -----------------------------------------------------------------------------------
    async def _upload_file(self, local_path: Path, remote_path: str) -> None:
        dest = self._host_path(remote_path)

        def copy() -> None:
            if not local_path.is_file():
                raise FileTransferError(f"{local_path} is not a file: pass an existing local file")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(local_path, dest)
            shutil.copymode(local_path, dest)

        await self._files(copy, remote_path)

    async def _upload_dir(self, local_dir: Path, remote_dir: str) -> None:
        dest = self._host_path(remote_dir)

        def copy() -> None:
            if not local_dir.is_dir():
                raise FileTransferError(f"{local_dir} is not a directory: pass an existing local directory")
            shutil.copytree(local_dir, dest, symlinks=True, dirs_exist_ok=True)

        await self._files(copy, remote_dir)

    async def _download_file(self, remote_path: str, local_path: Path) -> None:
        src = self._host_path(remote_path)

        def copy() -> None:
            if not src.is_file():
                raise FileTransferError(f"{remote_path} is not a file in sandbox {self.id}")
            local_path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, local_path)

        await self._files(copy, remote_path)

    async def _download_dir(self, remote_dir: str, local_dir: Path) -> None:
        src = self._host_path(remote_dir)

        def copy() -> None:
            if not src.is_dir():
                raise FileTransferError(f"{remote_dir} is not a directory in sandbox {self.id}")
            shutil.copytree(src, local_dir, symlinks=True, dirs_exist_ok=True)

        await self._files(copy, remote_dir)

    async def _files(self, fn: Callable[[], None], what: str) -> None:
        try:
            await asyncio.to_thread(fn)
        except OSError as exc:
            raise FileTransferError(f"file transfer for {what} in sandbox {self.id} failed: {exc}") from exc


def _root_binds(workdir: str) -> list[str]:
    """Read-only binds of the host's top-level directories onto bwrap's fresh root (a tmpfs), so
    that the workdir can be created as a new mount point there."""
    top = workdir.strip("/").split("/", 1)[0]
    args: list[str] = []
    for name in sorted(os.listdir("/")):
        if name in ("proc", "dev", "tmp", top):
            continue
        path = "/" + name
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


class _Process:
    """A child in its own session and process group, run the same way on every event loop.

    ``subprocess.Popen`` closes every inherited fd in the child (``close_fds``), which uvloop's spawn
    does not; the pipes are read and the exit is awaited through the running loop (a pidfd), so no
    thread is held per command however long it runs.
    """

    def __init__(self, argv: list[str], *, cwd: str, env: dict[str, str], popen_kwargs: dict[str, object]) -> None:
        self._popen = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, env=env,
            start_new_session=True, close_fds=True, **popen_kwargs,  # type: ignore[call-overload]
        )
        self.pid = self._popen.pid
        loop = asyncio.get_running_loop()
        self._out = _Collector(loop)
        self._err = _Collector(loop)
        self._exited: asyncio.Future[int] = loop.create_future()
        self._transports: list[asyncio.BaseTransport] = []
        self._pidfd: int | None = None
        self._started = asyncio.ensure_future(self._connect(loop))
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except OSError:  # no pidfd (old kernel): poll for the exit instead
            self._poller = asyncio.ensure_future(self._poll_exit())
        else:
            loop.add_reader(self._pidfd, self._reap)

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self._popen.stdout is not None and self._popen.stderr is not None
        for pipe, collector in ((self._popen.stdout, self._out), (self._popen.stderr, self._err)):
            transport, _ = await loop.connect_read_pipe(lambda c=collector: c, pipe)  # type: ignore[misc]
            self._transports.append(transport)

    def _reap(self) -> None:
        code = self._popen.poll()
        if code is None:
            return
        self._close_pidfd()
        if not self._exited.done():
            self._exited.set_result(code)

    async def _poll_exit(self) -> None:
        while (code := self._popen.poll()) is None:  # noqa: ASYNC110 (no event to wait on without a pidfd)
            await asyncio.sleep(0.05)
        if not self._exited.done():
            self._exited.set_result(code)

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    async def communicate(self, timeout: float | None) -> tuple[bytes, bytes]:
        """Wait for the exit and the end of both pipes: ``(stdout, stderr)``; TimeoutError after ``timeout``."""
        async with asyncio.timeout(timeout):
            await self._started
            await asyncio.gather(asyncio.shield(self._exited), asyncio.shield(self._out.closed),
                                 asyncio.shield(self._err.closed))
        self._close_transports()
        return bytes(self._out.data), bytes(self._err.data)

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)

    def abandon(self) -> tuple[bytes, bytes]:
        """Stop reading (something outside the group holds the pipes); reap the child if it has exited."""
        self._close_transports()
        if self._popen.poll() is not None:
            self._close_pidfd()
        return b"", b""

    def _close_transports(self) -> None:
        for transport in self._transports:
            transport.close()
        self._transports.clear()
        for pipe in (self._popen.stdout, self._popen.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


class _Collector(asyncio.Protocol):
    """Collects what one pipe carries; ``closed`` resolves at its end."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.data = bytearray()
        self.closed: asyncio.Future[None] = loop.create_future()

    def data_received(self, data: bytes) -> None:
        self.data += data

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- garbage collection hooks (see janitor.collect_garbage) -----------------------------------------


def gc_candidates() -> list[tuple[str, dict[str, str]]]:
    root = local_root()
    found: list[tuple[str, dict[str, str]]] = []
    if not root.is_dir():
        return found
    for entry in root.iterdir():
        try:
            info = json.loads((entry / _OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        labels = info.get("labels") or {}
        if janitor.OWNER_LABEL in labels:
            found.append((entry.name, labels))
    return found


def gc_remove(ref: str) -> None:
    _kill_tagged_processes(ref)
    shutil.rmtree(local_root() / ref, ignore_errors=True)
