"""What a sandbox should look like: :class:`SandboxSpec` and :class:`Resources`."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def parse_size(value: int | str | None) -> int | None:
    """Turn ``512m``, ``2g``, ``1.5GiB`` or a byte count into bytes (``None`` stays ``None``)."""
    if value is None:
        return None
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative, got {value}")
        return value
    match = _SIZE_RE.match(value)
    if not match:
        raise ValueError(f"cannot read size {value!r}: write it as bytes or like '512m', '2g'")
    number, unit = match.groups()
    return int(float(number) * _UNITS[unit.lower()])


def format_size(n: int) -> str:
    """``n`` bytes as people write it: ``256 MiB``, ``1.5 GiB``, ``1000 bytes`` (a unit only where it is
    exact to a sixteenth, so a limit reads back as it was set)."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor and n % (factor // 16 or 1) == 0:
            return f"{n / factor:g} {unit}"
    return f"{n} bytes"


# The kernel's limit on a unix socket path (sun_path is 108 bytes, NUL included).
_MAX_SOCKET_PATH = 107


def check_forward(port: int, host_socket: str) -> None:
    """Raise ValueError unless ``port`` is a TCP port and ``host_socket`` an absolute unix socket path."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"forward port must be an integer in 1..65535, got {port!r}")
    if not isinstance(host_socket, str) or not host_socket.startswith("/"):
        raise ValueError(
            f"forward target must be an absolute path to a unix socket on the host, got {host_socket!r}")
    if len(host_socket.encode()) > _MAX_SOCKET_PATH or "\0" in host_socket:
        raise ValueError(
            f"unix socket path too long or invalid (max {_MAX_SOCKET_PATH} bytes): {host_socket!r}")


@dataclass(frozen=True)
class Resources:
    """Limits for one sandbox. ``None`` means the backend's default: no limit on local; on Docker
    ``DockerSandbox(default_memory=8 GiB, default_pids=4096)`` and no disk limit.

    ``memory`` caps the sandbox's RAM (its processes and the tmpfs pages they write), ``pids`` the
    number of processes and threads alive at once, ``disk`` what its writable directories may hold.
    A sandbox that hits one reports it through :meth:`BaseSandbox.limits_reached
    <sandbox.protocol.BaseSandbox.limits_reached>`; the episode then ends with ``<name>_limit``.
    """

    cpus: float | None = None
    memory: int | str | None = None
    disk: int | str | None = None
    gpus: int | None = None
    pids: int | None = None

    @property
    def memory_bytes(self) -> int | None:
        return parse_size(self.memory)

    @property
    def disk_bytes(self) -> int | None:
        return parse_size(self.disk)


@dataclass
class SandboxSpec:
    """Describes a sandbox.

    Exactly one of ``image`` (a tag) or ``dockerfile`` (a path to a Dockerfile, built with
    ``build_context`` or the Dockerfile's own directory as context) should be given for the container
    backends; the local backend ignores both.

    ``network`` is ``"host"`` (the default: the sandbox reaches services on the host's 127.0.0.1),
    ``"none"`` (no network at all: only the sandbox's own loopback, plus the relays of ``forwards``),
    or a backend-specific network name.

    ``forwards`` maps a port on the sandbox's own 127.0.0.1 to a unix socket on the host: from
    ``start()`` on, a connection to ``127.0.0.1:port`` inside reaches that socket (see
    :meth:`BaseSandbox.forward <sandbox.protocol.BaseSandbox.forward>`).  It needs ``network="none"``.
    Docker bind-mounts each socket's *directory* read-only when the container is created, so later
    ``forward()`` calls can use other sockets in those directories; give every session its own
    directory, or one sandbox could connect to another's socket.

    ``hardened`` (local backend; containers are separate already) narrows what the sandbox sees: only
    the system directories (``/usr``, ``/bin``, ``/lib*``, ``/sbin``, ``/etc``), ``/opt/ares-agents``
    and ``readonly_paths`` read-only; the workdir, a private ``/tmp`` and ``/home/agent`` writable; no
    host home directory, repository, dataset or socket.  An ``agent`` user (uid 1000) exists there;
    commands run as a non-root user have no capabilities and ``no_new_privs``; root (``user=None`` or
    ``"root"``, for installs and verifiers) is not the host's root: Docker's default capabilities less
    ``MKNOD``, ``NET_RAW`` and ``SETFCAP`` (no ``DAC_READ_SEARCH``, no ``SYS_ADMIN``), ``HOME=/root``,
    the system ``PATH`` and none of the caller's ``PYTHON*``/``LD_*`` variables.  Every command, root's
    too, runs under a seccomp filter that refuses new user namespaces, mounts, file handles, the
    keyring, ptrace and module loading.
    """

    image: str | None = None
    dockerfile: str | Path | None = None
    build_context: str | Path | None = None
    workdir: str = "/workspace"
    env: dict[str, str] = field(default_factory=dict)
    resources: Resources = field(default_factory=Resources)
    network: str = "host"
    labels: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    name: str | None = None
    forwards: dict[int, str] = field(default_factory=dict)
    hardened: bool = False
    readonly_paths: tuple[str, ...] = ()
    # Remote backends only (Daytona): minutes of inactivity before the sandbox is stopped, and minutes
    # after stopping before it is deleted.  They are the safety net should every cleanup path fail.
    auto_stop_minutes: int | None = 60
    auto_delete_minutes: int | None = 0

    def __post_init__(self) -> None:
        if self.image and self.dockerfile:
            raise ValueError("give either image= or dockerfile=, not both")
        if not self.workdir.startswith("/"):
            raise ValueError(f"workdir must be an absolute path inside the sandbox, got {self.workdir!r}")
        for key in self.env:
            if not key or "=" in key or "\0" in key:
                raise ValueError(f"invalid environment variable name {key!r}")
        for port, socket_path in self.forwards.items():
            check_forward(port, socket_path)
        for path in self.readonly_paths:
            if not str(path).startswith("/"):
                raise ValueError(f"readonly_paths must be absolute host paths, got {path!r}")

    def dockerfile_path(self) -> Path | None:
        return Path(self.dockerfile).resolve() if self.dockerfile else None

    def context_path(self) -> Path | None:
        path = self.dockerfile_path()
        if path is None:
            return None
        return Path(self.build_context).resolve() if self.build_context else path.parent

    def dockerfile_hash(self) -> str:
        """Content hash of the Dockerfile and every file of its build context (the image cache key)."""
        path = self.dockerfile_path()
        context = self.context_path()
        if path is None or context is None:
            raise ValueError("this spec has no dockerfile")
        if not path.is_file():
            raise FileNotFoundError(f"Dockerfile not found: {path}")
        digest = hashlib.sha256()
        digest.update(b"dockerfile\0" + path.read_bytes())
        if context.is_dir():
            for item in sorted(context.rglob("*")):
                if item.is_file() and not item.is_symlink():
                    rel = item.relative_to(context).as_posix()
                    digest.update(b"\0file\0" + rel.encode() + b"\0" + item.read_bytes())
        return digest.hexdigest()
