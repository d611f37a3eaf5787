"""``ModalSandbox``: a remote sandbox on Modal, driven through the ``modal`` package's async API.

Install with ``pip install 'ares-gateway[modal]'`` and set ``MODAL_TOKEN_ID`` and ``MODAL_TOKEN_SECRET``
(or run ``modal token new``, which writes ``~/.modal.toml``).  The sandbox is created in the Modal app
``app_name`` (made on first use) from the spec's image (``Image.from_registry``), Dockerfile
(``Image.from_dockerfile``) or Modal's ``debian_slim``, with the spec's CPU and memory, a lifetime of
``sandbox_timeout`` seconds as the last line of defence against leaks, and tags for the janitor (owner,
session, creation time, sandbox id).  ``SandboxSpec(network="none")`` creates it with
``block_network=True``: no egress at all; :meth:`forward` then carries the agent's HTTP over an exec
channel (``sandbox.tunnel``), so the sandbox reaches exactly its own session.

Every operation is a ``sandbox.exec(..., text=False)``: commands run in a small POSIX wrapper that
changes directory, switches user (``runuser``/``sudo``; Modal's exec has no user) and runs the command
in its own session, recording the process-group id so that a timeout kills the whole group with a
second exec; files travel as tar streams over the exec's stdin/stdout.  :func:`modal_process_channel`
adapts one long-lived exec of the relay (``_relay.py --tunnel binary``) into a tunnel
:class:`~sandbox.tunnel.Channel`; it takes any object with the surface of ``modal``'s
``ContainerProcess`` (``stdin.write/write_eof/drain``, ``stdout``/``stderr`` async iterables of bytes,
``wait``), so it is tested without Modal's servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import math
import os
import posixpath
import secrets
import shlex
import tarfile
import tempfile
import time
from collections.abc import AsyncIterable, Awaitable, Callable
from pathlib import Path
from typing import IO, Any

from . import janitor
from ._procid import EXEC_DIR_SH, KILL_ALL, KILL_TOKEN, RECORD_AND_EXEC, RELAY_RECORD, USER_NAME_SH
from ._relay import READER_LIMIT
from .errors import BackendUnavailableError, ExecError, FileTransferError, ForwardError, SandboxStartError
from .protocol import (
    BaseSandbox,
    ExecResult,
)
from .registry import import_sdk
from .spec import SandboxSpec
from .tunnel import Channel, ReaderFlow, Tunnel, TunnelError

__all__ = ["MODAL_TAG", "ModalSandbox", "gc_candidates", "gc_remove", "modal_process_channel"]

#: The tag every sandbox of this backend carries (what gc lists by).
MODAL_TAG = "ares-gateway.backend"
_CWD_MISSING = 201
_MIB = 1024 * 1024
_ARES_DIR = "/.ares"
_RELAY_SCRIPT = Path(__file__).with_name("_relay.py")
_STREAM_CHUNK = 1 * _MIB

# $1 token, $2 cwd, $3 user ('' = the sandbox's default), $4 command, $5 RECORD_AND_EXEC.  The record
# of the command's session leader (pid and start time) is written by the wrapper's own user (root, or the
# default user
# that sudoes) into a directory only it can write, before the command switches user: the agent can
# neither point a later kill at another process nor block or forge the record.
_WRAPPER = EXEC_DIR_SH + r"""
p="$_ed/$1.pid"; d=$2; u=$3; c=$4; rec=$5
""" + USER_NAME_SH + r"""
if ! cd -- "$d" 2>/dev/null; then echo "ares-exec: no such directory: $d" >&2; exit 201; fi
if [ -z "$u" ]; then set -- /bin/sh -c "$c"
elif [ "$_uid" = 0 ]; then set -- runuser -u "$u" -- /bin/sh -c "$c"
else set -- sudo -n -u "$sudo_u" -- /bin/sh -c "$c"; fi
if command -v setsid >/dev/null 2>&1; then
  setsid -w /bin/sh -c "$rec" "$p" "$@" </dev/null; rc=$?
else
  /bin/sh -c "$rec" "$p" "$@" </dev/null; rc=$?
fi
rm -f "$p"; exit $rc
"""
_KILL = KILL_TOKEN
# $1 port, $2 max streams.  The relay of the exec tunnel on the exec's stdin/stdout.  A relay of this
# port left from an earlier channel (its exec never saw EOF) is killed first, only while its record
# still names that very process, freeing the port.  (As sandbox/docker.py's.)
_TUNNEL_RELAY = 'port=$1; d=/.ares; ' + RELAY_RECORD + (
    'exec python3 -I /.ares/relay.py --listen "127.0.0.1:$port" --tunnel binary '
    '--ready-file "$d/relay-$port.pid" --max-connections "$2"'
)


def _sdk() -> Any:
    return import_sdk("modal", backend="Modal", extra="modal")


def _check_credentials() -> None:
    """Raise unless a Modal token is configured (env vars or ~/.modal.toml); never says its value."""
    if os.environ.get("MODAL_TOKEN_ID") and os.environ.get("MODAL_TOKEN_SECRET"):
        return
    _sdk()
    from modal.config import config

    if config.get("token_id") and config.get("token_secret"):
        return
    missing = [n for n in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET") if not os.environ.get(n)]
    raise BackendUnavailableError(
        f"the Modal backend needs a token: set {' and '.join(missing)} (or run `modal token new`)"
    )


def _aio(fn: Any) -> Callable[..., Awaitable[Any]]:
    """The async form of a ``modal`` method (its ``.aio``); a plain coroutine function as it is."""
    return getattr(fn, "aio", fn)  # type: ignore[no-any-return]


# -- the exec channel ---------------------------------------------------------------------------------


class _ProcessWriter:
    """A writer over a Modal process's stdin.  ``write`` queues; one pump hands the queue to
    ``stdin.write`` in chunks of at most ``chunk`` bytes and awaits ``stdin.drain()`` after each (Modal's
    writer takes at most 16 MiB between drains, and two drains at once would send a buffer twice).
    ``drain()`` waits while more than ``high_water`` bytes are queued or in flight."""

    def __init__(self, stdin: Any, *, high_water: int, chunk: int) -> None:
        self.stdin, self.high_water, self.chunk = stdin, high_water, chunk
        self.buf = bytearray()
        self.in_flight = 0
        self.error: BaseException | None = None
        self.closed = False
        self._wake = asyncio.Event()
        self._below = asyncio.Event()
        self._below.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._pump = asyncio.ensure_future(self._run())

    @property
    def transport(self) -> _ProcessWriter:  # what Mux asks for the write backlog
        return self

    def get_write_buffer_size(self) -> int:
        return len(self.buf) + self.in_flight

    def _level(self) -> None:
        if self.get_write_buffer_size() > self.high_water and self.error is None and not self.closed:
            self._below.clear()
        else:
            self._below.set()

    def write(self, data: bytes) -> None:
        if self.closed or self.error is not None:
            return
        self.buf += data
        self._idle.clear()
        self._wake.set()
        self._level()

    async def _run(self) -> None:
        drain = _aio(self.stdin.drain)
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self.buf:
                    part = bytes(self.buf[:self.chunk])
                    del self.buf[:len(part)]
                    self.in_flight = len(part)
                    self.stdin.write(part)
                    await drain()
                    self.in_flight = 0
                    self._level()
                self._idle.set()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the SDK's errors too: the channel is broken
            self.error = exc
            self.buf.clear()
            self.in_flight = 0
            self._idle.set()
            self._level()

    async def drain(self) -> None:
        if self.error is not None:
            raise ConnectionResetError(f"the Modal exec's stdin failed: {self.error}")
        if self.closed:
            raise ConnectionResetError("the channel is closed")
        await self._below.wait()
        if self.error is not None:
            raise ConnectionResetError(f"the Modal exec's stdin failed: {self.error}")

    async def flush(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until everything written was handed to Modal."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._level()

    async def stop(self) -> None:
        self._pump.cancel()
        with contextlib.suppress(BaseException):
            await self._pump


async def _pump_stdout(stream: AsyncIterable[bytes], reader: asyncio.StreamReader,
                       reading: ReaderFlow) -> None:
    try:
        async for chunk in stream:
            if isinstance(chunk, str):  # text=True by mistake: the frames would be corrupted
                raise TypeError("the Modal exec must be started with text=False")
            if chunk:
                reader.feed_data(chunk)
            await reading.resumed.wait()
    except asyncio.CancelledError:
        if not reader.at_eof():
            reader.feed_eof()
        raise
    except Exception as exc:  # the SDK's stream failed: the channel is gone (the tunnel reopens it)
        reader.set_exception(ConnectionResetError(f"the Modal exec's stdout failed: {exc}"))
        return
    reader.feed_eof()


async def _collect(stream: AsyncIterable[bytes] | None, into: bytearray, cap: int) -> None:
    if stream is None:
        return
    with contextlib.suppress(Exception):
        async for chunk in stream:
            into += chunk.encode() if isinstance(chunk, str) else chunk
            del into[:-cap]


async def modal_process_channel(
    process: Any,
    *,
    description: str = "modal exec",
    high_water: int = 256 * 1024,
    chunk: int = _STREAM_CHUNK,
    exit_timeout: float = 5.0,
    stderr_cap: int = 64 * 1024,
) -> Channel:
    """A tunnel :class:`~sandbox.tunnel.Channel` over ``process``: a ``modal`` ``ContainerProcess``
    started with ``text=False`` running the relay in tunnel mode (or any object with its surface:
    ``stdin.write``/``write_eof``/``drain``, ``stdout``/``stderr`` async iterables of bytes, ``wait``).

    The relay's stdout feeds the channel's reader (its pump pauses while the reader holds more than
    twice ``READER_LIMIT``); frames go to its stdin in chunks of at most ``chunk`` bytes, ``drain()``
    waiting while more than ``high_water`` bytes are queued.  Closing sends stdin's EOF (the relay
    exits on it) and waits ``exit_timeout`` s for the process to end.
    """
    if high_water < 1 or chunk < 1 or exit_timeout <= 0:
        raise ValueError("high_water, chunk and exit_timeout must be positive")
    reader = asyncio.StreamReader(limit=READER_LIMIT)
    reading = ReaderFlow()
    reader.set_transport(reading)  # type: ignore[arg-type]
    writer = _ProcessWriter(process.stdin, high_water=high_water, chunk=chunk)
    stderr = bytearray()
    out_task = asyncio.ensure_future(_pump_stdout(process.stdout, reader, reading))
    err_task = asyncio.ensure_future(_collect(getattr(process, "stderr", None), stderr, stderr_cap))
    closed: list[bool] = []

    async def close() -> None:  # idempotent: drop() and the tunnel may both close a channel
        if closed:
            return
        closed.append(True)
        # Stop reading first: the SDK's gRPC stream would otherwise keep taking what the relay sends
        # (up to Modal's 64 MiB HTTP/2 window) while the relay is asked to exit.
        for task in (out_task, err_task):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        if not reader.at_eof() and reader.exception() is None:
            reader.feed_eof()
        writer.close()
        if writer.error is None:
            await writer.flush(exit_timeout)
        await writer.stop()
        with contextlib.suppress(Exception):
            process.stdin.write_eof()
            await asyncio.wait_for(_aio(process.stdin.drain)(), exit_timeout)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(_aio(process.wait)(), exit_timeout)

    return Channel(reader, writer, close, description, stderr)


# -- the backend ------------------------------------------------------------------------------------


class ModalSandbox(BaseSandbox):
    """A sandbox on Modal.  ``sandbox`` adopts an already created ``modal.Sandbox`` (or an object with
    its async surface: ``exec``, ``terminate``) instead of creating one; it is still terminated on stop.

    Limits: ``sandbox_timeout`` s of lifetime (Modal ends the sandbox then, whatever happens here),
    ``create_timeout`` s for creation, ``max_output`` bytes kept of each of a command's stdout and stderr,
    ``tunnel_max_streams`` concurrent streams per forwarded port.
    """

    backend = "modal"
    remote = True

    def __init__(
        self,
        spec: SandboxSpec | None = None,
        *,
        app_name: str = "ares-gateway",
        gpu: str | None = None,
        sandbox_timeout: int = 3600,
        create_timeout: float = 600.0,
        max_output: int = 64 * _MIB,
        tunnel_max_streams: int = 256,
        sandbox: Any = None,
    ) -> None:
        super().__init__(spec)
        if self.spec.network not in ("none", "host"):
            raise ValueError(f"Modal sandboxes have network 'none' (block_network) or 'host' (open egress), "
                             f"got {self.spec.network!r}")
        if sandbox_timeout < 1 or create_timeout <= 0 or max_output < 1 or tunnel_max_streams < 1:
            raise ValueError(
                "sandbox_timeout, create_timeout, max_output and tunnel_max_streams must be positive")
        if sandbox is None:
            _check_credentials()
        self.app_name, self.gpu = app_name, gpu
        self.sandbox_timeout, self.create_timeout = sandbox_timeout, create_timeout
        self.max_output, self.tunnel_max_streams = max_output, tunnel_max_streams
        self._sandbox: Any = sandbox
        self._adopted = sandbox is not None
        self.remote_id: str | None = getattr(sandbox, "object_id", None) if sandbox is not None else None
        self._tunnels: dict[int, Tunnel] = {}
        self._relay_uploaded = False

    @property
    def description(self) -> str:
        net = "block_network (no egress" + ("; forwards over an exec tunnel)" if self._forwards else ")") \
            if self.spec.network == "none" else "open egress"
        return f"modal sandbox {self.id} (remote id {self.remote_id}, app {self.app_name}, {net})"

    def tags(self) -> dict[str, str]:
        """The Modal tags: the janitor's labels, the sandbox id and the backend marker gc lists by."""
        return {**self.labels(), janitor.SANDBOX_LABEL: self.id, MODAL_TAG: "modal"}

    # -- lifecycle ---------------------------------------------------------------------------------
    def _create_kwargs(self, modal: Any, app: Any) -> dict[str, Any]:
        spec, res = self.spec, self.spec.resources
        if spec.image:
            image = modal.Image.from_registry(spec.image)
        elif spec.dockerfile:
            image = modal.Image.from_dockerfile(str(spec.dockerfile_path()),
                                                context_dir=str(spec.context_path()))
        else:
            image = modal.Image.debian_slim()
        kwargs: dict[str, Any] = {
            "app": app,
            "image": image,
            "env": dict(spec.env) or None,
            "timeout": self.sandbox_timeout,
            "block_network": spec.network == "none",
            "tags": self.tags(),  # at creation: no moment in which gc could not attribute it
        }
        if res.cpus:
            kwargs["cpu"] = float(res.cpus)
        if res.memory_bytes:
            kwargs["memory"] = max(1, math.ceil(res.memory_bytes / _MIB))
        if self.gpu or res.gpus:
            kwargs["gpu"] = self.gpu or (f"any:{res.gpus}" if res.gpus and res.gpus > 1 else "any")
        return kwargs

    async def _start(self) -> None:
        if self._sandbox is None:
            modal = _sdk()

            async def create() -> Any:
                app = await modal.App.lookup.aio(self.app_name, create_if_missing=True)
                # PID 1 sleeps; the sandbox lives until terminated or sandbox_timeout.
                return await modal.Sandbox.create.aio("sleep", "infinity", **self._create_kwargs(modal, app))

            try:
                self._sandbox = await asyncio.wait_for(create(), self.create_timeout)
            except Exception as exc:
                raise SandboxStartError(
                    f"Modal could not create sandbox {self.id} in app {self.app_name}: {exc}") from exc
            self.remote_id = str(self._sandbox.object_id)
        q = shlex.quote(self.spec.workdir)
        code, out, err = await self._raw(["/bin/sh", "-c", f"mkdir -p {q}"], timeout=120)
        if code != 0:
            raise SandboxStartError(f"cannot create workdir {self.spec.workdir} in Modal sandbox {self.id}: "
                                    f"{(out + err).decode(errors='replace').strip()[-500:]}")

    async def _stop(self) -> None:
        tunnels, self._tunnels = list(self._tunnels.values()), {}
        for tunnel in tunnels:
            await tunnel.close()
        if self._sandbox is None:
            return
        try:
            await _aio(self._sandbox.terminate)()
        except Exception:
            await asyncio.to_thread(self._remove_sync)

    def _remove_sync(self) -> None:
        """Terminate through the SDK's blocking API (its own event loop: safe from atexit and signals)."""
        if self._sandbox is None and self.remote_id is None:
            return
        with contextlib.suppress(Exception):
            (self._sandbox or _sdk().Sandbox.from_id(self.remote_id)).terminate()

    # -- exec ----------------------------------------------------------------------------------------
    async def _spawn(self, argv: list[str], *, env: dict[str, str] | None = None,
                     timeout: float | None = None) -> Any:
        try:
            return await _aio(self._sandbox.exec)(
                *argv, env=env or None, timeout=int(timeout) if timeout else None, text=False
            )
        except Exception as exc:
            raise ExecError(f"Modal exec in sandbox {self.id} failed: {exc}") from exc

    async def _communicate(self, proc: Any, stdin: IO[bytes] | None = None,
                           stdout: Callable[[bytes], None] | None = None) -> tuple[int, bytes, bytes]:
        """Feed ``stdin`` (then EOF), collect stdout (or hand it to ``stdout``) and stderr (at most
        ``max_output`` bytes each), and return the exit code."""
        out, err = bytearray(), bytearray()

        async def feed() -> None:
            if stdin is None:
                return
            drain = _aio(proc.stdin.drain)
            while chunk := await asyncio.to_thread(stdin.read, _STREAM_CHUNK):
                proc.stdin.write(chunk)
                await drain()
            proc.stdin.write_eof()
            await drain()

        async def read(stream: AsyncIterable[bytes], into: bytearray,
                       sink: Callable[[bytes], None] | None) -> None:
            async for chunk in stream:
                if sink is not None:
                    sink(chunk)
                elif len(into) < self.max_output:
                    into += chunk[: self.max_output - len(into)]

        await asyncio.gather(feed(), read(proc.stdout, out, stdout), read(proc.stderr, err, None))
        code = await _aio(proc.wait)()
        return int(code if code is not None else -1), bytes(out), bytes(err)

    async def _raw(self, argv: list[str], *, timeout: float, stdin: IO[bytes] | None = None,
                   stdout: Callable[[bytes], None] | None = None) -> tuple[int, bytes, bytes]:
        """One of the backend's own steps (mkdir, tar, the relay's upload), bounded by ``timeout``."""
        proc = await self._spawn(argv, timeout=timeout + 30)
        try:
            return await asyncio.wait_for(self._communicate(proc, stdin, stdout), timeout)
        except TimeoutError as exc:
            raise ExecError(f"{argv[-1][:60]!r} in Modal sandbox {self.id} took over {timeout:g} s") from exc

    async def _exec(
        self, command: str, *, cwd: str, env: dict[str, str], user: str | None, timeout: float | None
    ) -> ExecResult:
        pidfile = secrets.token_hex(12)  # the record's name in the wrapper's own directory
        argv = ["/bin/sh", "-c", _WRAPPER, "ares-exec", pidfile, cwd, user or "", command, RECORD_AND_EXEC]
        started = time.monotonic()
        # Modal's own deadline is only a backstop: ours kills the group inside first.
        proc = await self._spawn(argv, env=env, timeout=timeout + 60 if timeout else None)
        run = asyncio.ensure_future(self._communicate(proc))
        timed_out = False
        try:
            code, out, err = await asyncio.wait_for(asyncio.shield(run), timeout)
        except TimeoutError:
            timed_out = True
            await self._kill(pidfile)
            try:
                code, out, err = await asyncio.wait_for(run, 15)
            except Exception:  # something that left the group holds the output open
                run.cancel()
                code, out, err = -9, b"", b""
        except asyncio.CancelledError:
            await self._kill(pidfile)
            run.cancel()
            raise
        except Exception as exc:
            raise ExecError(f"Modal exec in sandbox {self.id} failed: {exc}") from exc
        stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
        if code == _CWD_MISSING and stderr.startswith("ares-exec: no such directory"):
            raise ExecError(f"cwd {cwd!r} does not exist in sandbox {self.id}: create it first (mkdir -p)")
        return ExecResult(stdout=stdout, stderr=stderr, exit_code=-9 if timed_out else code,
                          timed_out=timed_out, duration=time.monotonic() - started)

    async def _kill(self, pidfile: str) -> None:
        with contextlib.suppress(Exception):
            await self._raw(["/bin/sh", "-c", _KILL, pidfile], timeout=30)

    async def _kill_processes(self, user: str | None, timeout: float) -> int:
        uid = ""
        if user is not None:
            if user.isdigit():
                uid = user
            else:
                code, uid_b, err_b = await self._raw(["id", "-u", user], timeout=30)
                if code != 0:
                    raise ExecError(
                        f"no user {user!r} in sandbox {self.id}: {err_b.decode(errors='replace').strip()}")
                uid = uid_b.decode().strip()
        rounds = max(1, int(timeout / 0.05))
        code, out_b, err_b = await self._raw(["/bin/sh", "-c", KILL_ALL, "ares-kill", uid, str(rounds)],
                                             timeout=timeout + 30)
        out = out_b.decode(errors="replace").strip()
        if code != 0 or not out.isdigit():
            raise ExecError(f"killing the processes of sandbox {self.id} failed: "
                            f"{(out + err_b.decode(errors='replace')).strip()[-500:]}")
        return int(out)

    # -- files (tar over the exec's stdin/stdout) ------------------------------------------------------
    async def _put_tar(self, remote_dir: str, tar_stream: IO[bytes]) -> None:
        q = shlex.quote(remote_dir)
        try:
            code, out, err = await self._raw(
                ["/bin/sh", "-c", f"mkdir -p {q} && tar -xf - -C {q} --no-same-owner"],
                timeout=3600, stdin=tar_stream)
        finally:
            tar_stream.close()
        if code != 0:
            raise FileTransferError(f"copying into {remote_dir} in sandbox {self.id} failed: "
                                    f"{(out + err).decode(errors='replace').strip()[-500:]}")

    async def _uploaded(self, remote: str) -> None:
        if self.spec.user:
            code, _, err = await self._raw(["chown", "-R", self.spec.user, remote], timeout=600)
            if code != 0:
                raise FileTransferError(
                    f"giving {remote} to {self.spec.user} failed: {err.decode(errors='replace')}")

    async def _get_tar(self, directory: str, name: str) -> IO[bytes]:
        d, n = shlex.quote(directory), shlex.quote(name)
        if name == ".":
            script = f"[ -d {d} ] || {{ echo 'no such directory: '{d} >&2; exit 2; }}; tar -cf - -C {d} ."
        else:
            p = shlex.quote(posixpath.join(directory, name))
            script = f"[ -f {p} ] || {{ echo 'no such file: '{p} >&2; exit 2; }}; tar -cf - -C {d} -- {n}"
        spool: IO[bytes] = tempfile.SpooledTemporaryFile(max_size=32 * _MIB)  # type: ignore[assignment]
        try:
            def sink(chunk: bytes) -> None:
                spool.write(chunk)

            code, _, err = await self._raw(["/bin/sh", "-c", script], timeout=3600, stdout=sink)
            if code != 0:
                raise FileTransferError(f"copying {posixpath.join(directory, name)} out of sandbox {self.id} "
                                        f"failed: {err.decode(errors='replace').strip()[-500:]}")
        except BaseException:
            spool.close()
            raise
        spool.seek(0)
        return spool

    # -- forwarding (the exec tunnel) -------------------------------------------------------------------
    async def _upload_relay(self) -> None:
        data = _RELAY_SCRIPT.read_bytes()
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo("relay.py")
            info.size, info.mode, info.uid, info.gid = len(data), 0o644, 0, 0
            tar.addfile(info, io.BytesIO(data))
        buf.seek(0)
        script = (f"command -v python3 >/dev/null 2>&1 || {{ echo 'no python3' >&2; exit 3; }}; "
                  f"mkdir -p -m 755 {_ARES_DIR} && tar -xf - -C {_ARES_DIR}")
        code, _, err = await self._raw(["/bin/sh", "-c", script], timeout=120, stdin=buf)
        if code == 3:
            raise ForwardError(
                f"the image of sandbox {self.id} has no python3, which the exec tunnel's relay needs: "
                "use an image with python3")
        if code != 0:
            raise ForwardError(f"copying the relay into sandbox {self.id} failed: "
                               f"{err.decode(errors='replace').strip()[-500:]}")

    async def _forward(self, port: int, host_socket: str) -> None:
        """A relay in tunnel mode on a long-lived exec; its pid file spares it in kill_processes().
        Another exec replaces it when the channel drops (see sandbox.tunnel)."""
        if not self._relay_uploaded:
            await self._upload_relay()
            self._relay_uploaded = True
        argv = ["/bin/sh", "-c", _TUNNEL_RELAY, "ares-relay", str(port), str(self.tunnel_max_streams)]

        async def open_channel() -> Channel:
            proc = await _aio(self._sandbox.exec)(*argv, text=False)
            return await modal_process_channel(proc, description=f"modal exec in {self.remote_id or self.id}")

        tunnel = Tunnel(open_channel, host_socket, max_streams=self.tunnel_max_streams)
        try:
            await tunnel.start()
        except (TunnelError, OSError) as exc:
            raise ForwardError(
                f"the exec tunnel for port {port} of sandbox {self.id} did not start: {exc}") from exc
        self._tunnels[port] = tunnel

    def tunnel_for(self, port: int) -> Tunnel | None:
        """The exec tunnel serving ``port``, for its counters and tests."""
        return self._tunnels.get(port)


# -- garbage collection hooks (see sandbox.gc) --------------------------------------------------------


def gc_candidates() -> list[tuple[str, dict[str, str]]]:
    """Every Modal sandbox of this backend (by its tag) with its tags."""
    _check_credentials()
    modal = _sdk()
    found: list[tuple[str, dict[str, str]]] = []
    for sb in modal.Sandbox.list(tags={MODAL_TAG: "modal"}):
        tags = dict(sb.get_tags())
        if janitor.OWNER_LABEL in tags:
            found.append((str(sb.object_id), tags))
    return found


def gc_remove(ref: str) -> None:
    _check_credentials()
    _sdk().Sandbox.from_id(ref).terminate()
