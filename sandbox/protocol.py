"""The :class:`Sandbox` protocol, :class:`ExecResult`, and :class:`BaseSandbox`, which backends extend.

Two calls exist for the gateway's isolation of agents; both are on every backend's API:

``await sb.forward(port, host_socket)``
    Inside the sandbox, ``127.0.0.1:port`` (the sandbox's *own* loopback) now reaches the unix socket
    ``host_socket`` on the host.  It needs ``network="none"`` (with host networking the sandbox
    already shares the host's loopback, and a listener there would be the host's).  The gateway serves
    one unix socket per session, accepting only that session's agent endpoints, and points the agent's
    base URL at ``http://127.0.0.1:<port>``.  Declaring ``SandboxSpec(forwards={port: host_socket})``
    sets the same relays up during ``start()`` (Docker needs this: the socket's directory is bind-
    mounted when the container is created).  Each connection is piped by a small stdlib relay
    (``sandbox/_relay.py``), which the agent cannot kill or replace:

    * local: the relay runs as a host process that joined only the sandbox's network namespace
      (``nsenter -n``), so it sees the host's socket and nothing of the sandbox but its loopback;
    * docker: the relay runs as root inside the container (``python3`` of the image), the socket's
      directory mounted read-only at ``/.ares/forward/<n>`` (connect needs no write access); or,
      with ``tunnel="exec"``, the same relay in tunnel mode on a long-lived ``docker exec``;
    * a remote backend (daytona) cannot reach the host's socket: the relay runs inside in tunnel
      mode and carries each connection over the provider's own channel (an SSH exec channel or a
      PTY session), served by :class:`sandbox.tunnel.Tunnel` here: only ``_forward`` differs.

``await sb.kill_processes(user=None)``
    Kill every process in the sandbox except its own keeper/init (and the relays), and wait until
    they are gone; with ``user``, only that user's.  Run it before a verifier so that nothing the
    agent started (a detached loop rewriting a reward file) is left.  local: every member of the
    sandbox's cgroup, whatever namespace it made (bubblewrap as root), else every process of its PID
    namespace, else every process tagged ``ARES_SANDBOX_ID``;
    docker: every process of the container but PID 1 and its ``sleep infinity``.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import io
import os
import posixpath
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Protocol, Self, runtime_checkable

from . import janitor
from .errors import (
    ArchiveTooLargeError,
    ExecError,
    FileTransferError,
    ForwardError,
    NotSupportedError,
    SandboxStartError,
    SandboxStateError,
)
from .spec import SandboxSpec, check_forward
from .start_rate import wait_to_start

#: What :meth:`BaseSandbox.limits_reached` can report.
LIMIT_NAMES = frozenset({"memory", "pids", "disk"})

# Spill an in-flight tar stream to disk beyond this size instead of holding it in memory.
_SPOOL_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class ExecResult:
    """What one command did. ``exit_code`` is -9 (or the backend's kill status) when ``timed_out``."""

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    duration: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@runtime_checkable
class Sandbox(Protocol):
    """One isolated place to run commands and move files. Every backend implements this."""

    id: str
    backend: str
    spec: SandboxSpec

    @property
    def description(self) -> str: ...

    @property
    def state(self) -> str: ...

    async def start(self) -> None: ...

    async def exec(
        self,
        command: str | list[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        timeout: float | None = None,
    ) -> ExecResult: ...

    async def upload_file(self, local_path: str | os.PathLike[str], remote_path: str) -> None: ...

    async def upload_dir(self, local_dir: str | os.PathLike[str], remote_dir: str) -> None: ...

    async def download_file(self, remote_path: str, local_path: str | os.PathLike[str]) -> None: ...

    async def download_dir(self, remote_dir: str, local_dir: str | os.PathLike[str]) -> None: ...

    async def archive_dir(self, remote_dir: str, local_path: str | os.PathLike[str], *,
                          limit: int) -> int: ...

    async def forward(self, port: int, host_socket: str) -> None: ...

    async def kill_processes(self, *, user: str | None = None, timeout: float = 30.0) -> int: ...

    async def limits_reached(self) -> frozenset[str]: ...

    async def stop(self) -> None: ...

    def stop_and_remove(self) -> None: ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


#: ``sh -c USER_SWITCH NAME USER ARGV...`` run by root: ARGV as USER (see BaseSandbox.user_switch_argv).
USER_SWITCH = (
    'u=$1; shift; uid=$(id -u "$u") && gid=$(id -g "$u") || { echo "no user $u in this sandbox" >&2; '
    'exit 126; }; if command -v setpriv >/dev/null 2>&1; then exec setpriv --reuid="$uid" --regid="$gid" '
    '--init-groups -- "$@"; elif command -v runuser >/dev/null 2>&1; then exec runuser -u "$u" -- "$@"; fi; '
    'echo "switching to $u needs setpriv or runuser (util-linux) in this sandbox" >&2; exit 126'
)


def command_to_shell(command: str | list[str]) -> str:
    """A command as one ``sh -c`` string: a string is used as is, a list is quoted word by word."""
    if isinstance(command, str):
        return command
    import shlex

    return shlex.join(command)


def tar_directory(local_dir: Path) -> IO[bytes]:
    """The contents of ``local_dir`` as an uncompressed tar stream (spooled to disk when large)."""
    if not local_dir.is_dir():
        raise FileTransferError(f"{local_dir} is not a directory: pass an existing local directory")
    spool = tempfile.SpooledTemporaryFile(max_size=_SPOOL_BYTES)
    with tarfile.open(fileobj=spool, mode="w") as tar:
        for entry in sorted(local_dir.iterdir()):
            tar.add(entry, arcname=entry.name)
    spool.seek(0)
    return spool  # type: ignore[return-value]


def tar_single_file(local_path: Path, arcname: str) -> IO[bytes]:
    if not local_path.is_file():
        raise FileTransferError(f"{local_path} is not a file: pass an existing local file")
    spool = tempfile.SpooledTemporaryFile(max_size=_SPOOL_BYTES)
    with tarfile.open(fileobj=spool, mode="w") as tar:
        tar.add(local_path, arcname=arcname)
    spool.seek(0)
    return spool  # type: ignore[return-value]


def extract_tar(stream: IO[bytes], dest: Path, *, strip_top: bool = False) -> None:
    """Extract a tar stream into ``dest`` refusing anything that escapes it (the ``data`` filter)."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=stream, mode="r|*") as tar:
        for member in tar:
            name = member.name
            if strip_top:
                parts = name.split("/", 1)
                if len(parts) == 1 or not parts[1]:
                    continue
                member.name = parts[1]
            tar.extract(member, dest, filter="data")


#: What :func:`filter_tar` keeps: regular files, directories, symbolic links and hard links.
_KEPT_TAR_TYPES = frozenset(
    {tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE})


def filter_tar(src: IO[bytes], dst: IO[bytes], *, limit: int, strip_top: bool = False) -> int:
    """Copy a tar stream from ``src`` to ``dst`` keeping regular files, directories, symbolic links
    and hard links (their targets as written, never resolved here), with owners and set-id bits
    cleared; FIFOs, sockets, device nodes, other types, and names that are absolute or hold ``..``
    are left out. Nothing is written to disk but ``dst``. ``strip_top`` drops each name's first
    component. Returns the bytes written; raises :class:`ArchiveTooLargeError` once the archive would
    pass ``limit`` bytes, :class:`FileTransferError` when ``src`` is not a whole tar archive."""
    try:
        return _filter_tar(src, _Bounded(dst, limit), strip_top)
    except tarfile.TarError as exc:
        raise FileTransferError(f"not a complete tar archive: {exc}") from None


def _filter_tar(src: IO[bytes], out: _Bounded, strip_top: bool) -> int:
    def unsafe(name: str) -> bool:
        return name.startswith("/") or ".." in name.split("/")

    with tarfile.open(fileobj=src, mode="r|") as tin, tarfile.open(
        fileobj=out, mode="w|", format=tarfile.GNU_FORMAT) as tout:  # type: ignore[call-overload]
        for member in tin:
            if member.type not in _KEPT_TAR_TYPES:
                continue
            if strip_top:
                parts = member.name.split("/", 1)
                if len(parts) == 1 or not parts[1]:
                    continue
                member.name = parts[1]
                if member.type == tarfile.LNKTYPE:
                    member.linkname = member.linkname.split("/", 1)[-1]
            if unsafe(member.name) or (member.type == tarfile.LNKTYPE and unsafe(member.linkname)):
                continue
            size = member.size if member.type in (tarfile.REGTYPE, tarfile.AREGTYPE) else 0
            out.reserve(size)
            member.mode &= 0o777
            member.uid = member.gid = 0
            member.uname = member.gname = ""
            member.pax_headers = {}
            tout.addfile(member, tin.extractfile(member) if size else None)
    return out.written


def filter_tar_file(src: Path, dst: Path, *, limit: int, strip_top: bool = False) -> int:
    """:func:`filter_tar` from the file ``src`` into the file ``dst``."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        return filter_tar(fin, fout, limit=limit, strip_top=strip_top)


class _Bounded(io.RawIOBase):
    """A write-only file object that counts what passes to ``dst`` and refuses more than ``limit`` bytes."""

    def __init__(self, dst: IO[bytes], limit: int) -> None:
        self.dst, self.limit, self.written = dst, limit, 0

    def writable(self) -> bool:
        return True

    def reserve(self, n: int) -> None:
        if self.written + n > self.limit:
            raise ArchiveTooLargeError(f"the archive passes {self.limit} bytes")

    def write(self, b: bytes) -> int:  # type: ignore[override]
        self.reserve(len(b))
        self.written += len(b)
        return self.dst.write(b)


def extract_single_file(stream: IO[bytes], local_path: Path) -> None:
    """Write the first regular file of a tar stream to ``local_path``."""
    with tarfile.open(fileobj=stream, mode="r|*") as tar:
        for member in tar:
            if member.isfile():
                source = tar.extractfile(member)
                if source is None:
                    break
                local_path.parent.mkdir(parents=True, exist_ok=True)
                with open(local_path, "wb") as out:
                    while chunk := source.read(1024 * 1024):
                        out.write(chunk)
                return
    raise FileTransferError(f"no regular file in the archive for {local_path}: is the remote path a file?")


class IterStream(io.RawIOBase):
    """A read-only file object over an iterator of byte chunks (for streaming tar extraction)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._it = iter(chunks)
        self._buf = b""

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray) -> int:  # type: ignore[override]
        while not self._buf:
            try:
                self._buf = next(self._it)
            except StopIteration:
                return 0
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


class BaseSandbox(abc.ABC):
    """Shared lifecycle of every backend: state checks, janitor registration, ``async with``."""

    backend: str = "base"
    #: A sandbox on another machine (Daytona, Kubernetes, Modal): its loopback is its own whatever its
    #: network, so its forwards (over the exec tunnel) work with an open network too; on this host
    #: they need ``network="none"`` (with the host's network the relay would listen on the host).
    remote: bool = False
    #: How long :meth:`stop` waits for a start under way to settle before it returns; a start that
    #: settles later removes what it made itself.
    stop_waits_for_start: float = 60.0

    def __init__(self, spec: SandboxSpec | None = None) -> None:
        self.spec = spec or SandboxSpec()
        self.id = uuid.uuid4().hex[:12]
        self._state = "created"
        self._lock = threading.Lock()
        #: Set once a start under way has settled (started or failed); ``None`` before any start.
        self._starting: asyncio.Event | None = None
        self.created_at = time.time()
        self._forwards: dict[int, str] = {}

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def state(self) -> str:
        """``created``, ``running`` or ``stopped``."""
        return self._state

    @property
    @abc.abstractmethod
    def description(self) -> str:
        """One line saying what this sandbox is and how isolated it is."""

    def labels(self) -> dict[str, str]:
        """The labels put on the sandbox: the spec's own plus owner, session and creation time."""
        return {**self.spec.labels, **janitor.owner_labels(),
                janitor.CREATED_LABEL: str(int(self.created_at))}

    async def start(self) -> None:
        if self._state == "running":
            return
        if self._state == "stopped":
            raise SandboxStateError(
                f"sandbox {self.id} was stopped and cannot be started again: create a new one with "
                "sandbox.create()"
            )
        if self.spec.forwards and self.spec.network != "none" and not self.remote:
            raise SandboxStartError(
                f"SandboxSpec.forwards needs network='none' (got {self.spec.network!r}): with host "
                "networking the sandbox already shares the host's loopback"
            )
        if self.spec.forwards and type(self)._forward is BaseSandbox._forward:
            await self._forward(0, "")  # raises NotSupportedError before anything is created
        self._starting = settled = asyncio.Event()
        try:
            await self._start_settled()
        finally:
            settled.set()

    async def _start_settled(self) -> None:
        await wait_to_start(self.backend)  # a provider's creation rate (sandbox.start_rate)
        if self._state == "stopped":
            raise SandboxStateError(f"sandbox {self.id} was stopped before it started")
        janitor.register(self)
        try:
            await self._start()
            for port, host_socket in self.spec.forwards.items():
                await self._forward(port, host_socket)
                self._forwards[port] = host_socket
        except BaseException:
            try:
                self._remove_sync()
            finally:
                janitor.unregister(self)
                self._state = "stopped"
            raise
        with self._lock:
            removed = self._state == "stopped"
            if not removed:
                self._state = "running"
        if removed:  # stopped while it started (stop_and_remove, a stop that waited no longer): remove it
            try:
                self._remove_sync()
            finally:
                janitor.unregister(self)
            raise SandboxStateError(f"sandbox {self.id} was stopped while it started")

    async def stop(self) -> None:
        """Stop and remove the sandbox. Safe to call twice.

        Cancelled or failed midway, the sandbox counts as running again, so that
        :meth:`stop_and_remove`, a later ``stop()`` or the janitor at exit still removes it (a
        removal queued for a worker thread and cancelled there never ran). A start under way is let
        settle first (up to :attr:`stop_waits_for_start` seconds), then what it made is removed; one
        still going after that removes what it made once it is done, and raises."""
        starting = self._starting
        if starting is not None and not starting.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(starting.wait(), self.stop_waits_for_start)
        with self._lock:
            if self._state == "stopped":
                return
            was_started = self._state == "running"
            self._state = "stopped"
        if was_started:
            try:
                await self._stop()
            except BaseException:
                with self._lock:
                    self._state = "running"
                raise
        janitor.unregister(self)

    def stop_and_remove(self) -> None:
        """Synchronous, idempotent removal; safe from atexit and signal handlers."""
        with self._lock:
            if self._state == "stopped":
                janitor.unregister(self)
                return
            self._state = "stopped"
        try:
            self._remove_sync()
        finally:
            janitor.unregister(self)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    @property
    def workdir(self) -> str:
        """The working directory inside the sandbox (relative remote paths are resolved against it)."""
        return self.spec.workdir

    def _require_running(self, what: str) -> None:
        if self._state == "created":
            raise SandboxStateError(
                f"cannot {what}: sandbox {self.id} is not started; call `await sb.start()` first")
        if self._state == "stopped":
            raise SandboxStateError(
                f"cannot {what}: sandbox {self.id} ({self.backend}) has been stopped; create a new sandbox"
            )

    # -- operations --------------------------------------------------------------------------------
    async def exec(
        self,
        command: str | list[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        timeout: float | None = None,
    ) -> ExecResult:
        """Run ``command`` with ``sh -c`` (a list is quoted), in ``cwd`` (default: the spec's workdir).

        ``env`` is added to the spec's environment. ``timeout`` (seconds) kills the command's whole
        process group inside the sandbox and returns with ``timed_out=True``; it is never re-run.
        """
        self._require_running("exec")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        merged = {**self.spec.env, **(env or {})}
        for key in merged:
            if not key or "=" in key:
                raise ExecError(f"invalid environment variable name {key!r}")
        return await self._exec(
            command_to_shell(command),
            cwd=self._abs(cwd) if cwd else self.workdir,
            env=merged,
            user=user or self.spec.user,
            timeout=timeout,
        )

    async def upload_file(self, local_path: str | os.PathLike[str], remote_path: str) -> None:
        self._require_running("upload a file")
        await self._upload_file(Path(local_path), self._abs(remote_path))

    async def upload_dir(self, local_dir: str | os.PathLike[str], remote_dir: str) -> None:
        self._require_running("upload a directory")
        await self._upload_dir(Path(local_dir), self._abs(remote_dir))

    async def download_file(self, remote_path: str, local_path: str | os.PathLike[str]) -> None:
        self._require_running("download a file")
        await self._download_file(self._abs(remote_path), Path(local_path))

    async def download_dir(self, remote_dir: str, local_dir: str | os.PathLike[str]) -> None:
        self._require_running("download a directory")
        await self._download_dir(self._abs(remote_dir), Path(local_dir))

    async def archive_dir(self, remote_dir: str, local_path: str | os.PathLike[str], *, limit: int) -> int:
        """Write an uncompressed tar of ``remote_dir``'s contents to the local file ``local_path``, as
        :func:`filter_tar` keeps them: made inside the sandbox (symbolic links stored as links, none
        followed), streamed here, never unpacked on this host. Returns its size; raises
        :class:`ArchiveTooLargeError` when it would pass ``limit`` bytes, :class:`FileTransferError`
        when it cannot be made."""
        self._require_running("archive a directory")
        return await self._archive_dir(self._abs(remote_dir), Path(local_path), limit)

    @property
    def forwards(self) -> dict[int, str]:
        """The ports forwarded so far: sandbox port -> host unix socket."""
        return dict(self._forwards)

    async def forward(self, port: int, host_socket: str) -> None:
        """Make ``127.0.0.1:port`` inside the sandbox reach the host's unix socket ``host_socket``.

        Needs ``network="none"``.  Forwarding a port again to the same socket does nothing; to another
        socket raises :class:`ForwardError`.  The socket need not exist yet (each connection opens it
        anew; one made before it exists is closed at once).  The relay lives until the sandbox stops.
        Raises :class:`NotSupportedError` on a backend that cannot forward.
        """
        self._require_running("forward a port")
        try:
            check_forward(port, host_socket)
        except ValueError as exc:
            raise ForwardError(str(exc)) from exc
        if self.spec.network != "none" and not self.remote:
            raise ForwardError(
                "forward() needs SandboxSpec(network='none'), this sandbox has "
                f"network={self.spec.network!r}: with "
                "host networking the sandbox shares the host's loopback and the relay would "
                "listen on the host"
            )
        known = self._forwards.get(port)
        if known == host_socket:
            return
        if known is not None:
            raise ForwardError(
                f"port {port} of sandbox {self.id} already forwards to {known}; use another port")
        await self._forward(port, host_socket)
        self._forwards[port] = host_socket

    async def kill_processes(self, *, user: str | None = None, timeout: float = 30.0) -> int:
        """Kill every process in the sandbox but its own keeper (and relays); wait until they are gone.

        ``user`` (a name or uid) limits it to that user's processes.  Returns how many were killed.
        Processes that fork while being killed are killed in further rounds; raises :class:`ExecError`
        if any is still alive after ``timeout`` seconds.
        """
        self._require_running("kill processes")
        return await self._kill_processes(user, timeout)

    async def limits_reached(self) -> frozenset[str]:
        """The resource limits of ``spec.resources`` this sandbox has hit so far: a subset of
        :data:`LIMIT_NAMES` (``"memory"``: a process was killed for memory; ``"pids"``: a fork was
        refused; ``"disk"``: a write found the writable space full). Empty where the backend enforces
        none or cannot tell. Never raises."""
        try:
            return await self._limits_reached()
        except Exception:  # a sandbox already gone, a counter unreadable: nothing to report
            return frozenset()

    async def _limits_reached(self) -> frozenset[str]:
        return frozenset()

    def _abs(self, remote_path: str) -> str:
        if remote_path.startswith("/"):
            return posixpath.normpath(remote_path)
        return posixpath.normpath(posixpath.join(self.workdir, remote_path))

    # -- what backends implement -------------------------------------------------------------------
    @abc.abstractmethod
    async def _start(self) -> None: ...

    @abc.abstractmethod
    async def _exec(
        self, command: str, *, cwd: str, env: dict[str, str], user: str | None, timeout: float | None
    ) -> ExecResult: ...

    # File transfer is built once, here, from two tar primitives a backend implements: _put_tar and
    # _get_tar (Docker's archive API, Kubernetes' and Modal's exec streams). A backend with a transfer
    # of its own overrides the four methods instead (local: tar run inside a hardened sandbox;
    # Daytona: its upload endpoint and a tar unpacked by exec).
    async def _put_tar(self, remote_dir: str, tar_stream: IO[bytes]) -> None:
        """Unpack ``tar_stream`` into ``remote_dir`` inside the sandbox (created if missing); raise
        :class:`FileTransferError` when that fails."""
        raise NotImplementedError(f"the {self.backend} backend implements its own file transfer")

    async def _get_tar(self, directory: str, name: str) -> IO[bytes]:
        """A tar stream of ``name`` in ``directory`` as made inside the sandbox (``name="."``: the
        directory's contents; the stream may hold it under its own name, which is stripped); raise
        :class:`FileTransferError` when ``directory/name`` is missing or cannot be read."""
        raise NotImplementedError(f"the {self.backend} backend implements its own file transfer")

    async def _uploaded(self, remote: str) -> None:  # noqa: B027 (a hook: most backends need nothing)
        """Called once an upload landed at ``remote`` (Docker, Kubernetes and Modal give it to
        ``spec.user``)."""

    async def _upload_file(self, local_path: Path, remote_path: str) -> None:
        parent, name = posixpath.split(remote_path)
        await self._put_tar(parent or "/", await asyncio.to_thread(tar_single_file, local_path, name))
        await self._uploaded(remote_path)

    async def _upload_dir(self, local_dir: Path, remote_dir: str) -> None:
        await self._put_tar(remote_dir, await asyncio.to_thread(tar_directory, local_dir))
        await self._uploaded(remote_dir)

    async def _download_file(self, remote_path: str, local_path: Path) -> None:
        parent, name = posixpath.split(remote_path)
        stream = await self._get_tar(parent or "/", name)
        try:
            await asyncio.to_thread(extract_single_file, stream, local_path)
        finally:
            stream.close()

    async def _download_dir(self, remote_dir: str, local_dir: Path) -> None:
        stream = await self._get_tar(remote_dir.rstrip("/") or "/", ".")
        try:
            await asyncio.to_thread(extract_tar, stream, local_dir, strip_top=True)
        finally:
            stream.close()

    async def _archive_dir(self, remote_dir: str, local_path: Path, limit: int) -> int:
        """Any backend: ``tar`` into a temporary directory of root's inside (it takes the sandbox's
        disk while it exists), then :meth:`download_file` and :func:`filter_tar`."""
        import shlex

        root = None if self.backend == "local" else "root"
        q = shlex.quote(remote_dir)
        made = await self.exec(
            f'd=$(mktemp -d) && cd {q} && {{ tar -cf - . | head -c {limit + 1024 * 1024} > "$d/a.tar"; }} '
            '&& printf "%s" "$d"',
            cwd="/", user=root, timeout=600)
        if not made.ok:
            raise FileTransferError(
                f"archiving {remote_dir} in sandbox {self.id} failed: {made.stderr.strip()[-300:]}")
        inside = made.stdout.strip()
        try:
            with tempfile.TemporaryDirectory() as tmp:
                raw = Path(tmp) / "a.tar"
                await self.download_file(posixpath.join(inside, "a.tar"), raw)
                import asyncio

                return await asyncio.to_thread(filter_tar_file, raw, local_path, limit=limit)
        finally:
            await self.exec(f"rm -rf {shlex.quote(inside)}", cwd="/", user=root, timeout=60)

    async def _forward(self, port: int, host_socket: str) -> None:
        raise NotSupportedError(
            f"the {self.backend} backend cannot forward ports yet: use the local or docker backend "
            "(or network access) for sandboxes that must reach a host socket"
        )

    async def _kill_processes(self, user: str | None, timeout: float) -> int:
        raise NotSupportedError(
            f"the {self.backend} backend cannot kill all processes yet: use local or docker")

    def user_switch_argv(self, user: str) -> list[str]:
        """An argv prefix that, run by root inside this sandbox, runs the rest as ``user``: its uid, gid
        and groups (``setpriv``, else ``runuser``), with the privileges ``exec(user=user)`` gives it.

        For a root process that must outlive and watch what it starts (a launcher recording an exit
        code where the user cannot write); the environment is the caller's to set.
        """
        return ["/bin/sh", "-c", USER_SWITCH, "ares-switch", user]

    async def _stop(self) -> None:
        import asyncio

        await asyncio.to_thread(self._remove_sync)

    @abc.abstractmethod
    def _remove_sync(self) -> None:
        """Remove everything this sandbox holds; must not raise if it is already gone."""
