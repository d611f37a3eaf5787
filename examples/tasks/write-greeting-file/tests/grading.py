"""What the bundled tasks' verifiers share (each task carries an identical copy of this file, since a
task directory must stand alone).

A verifier runs as root with ``python3 -I`` in the task's workdir, after the agent. Everything the agent
left there is data to it, never code:

* :func:`read_file` reads a workspace file only when it is a regular file (not a symlink, FIFO or
  device), without blocking, and at most ``limit`` bytes: a link to ``/dev/zero`` or ``/tests``, a FIFO
  or a sparse 10 GB file is refused, not read.
* :func:`run_untrusted` runs the agent's code in a process of its own: as uid/gid 65534 (neither root
  nor the agent) when the verifier is root, ``python3 -I -B``, a minimal environment, a private copy of
  the files it needs as its working directory, a timeout, resource limits and bounded output; every
  process it leaves is killed before the verdict. The verifier's tests directory is closed to it. Its
  only channel back is its stdout, which the verifier parses as untrusted JSON (:func:`parse_json`)
  and checks, value by value, against its own reference.
* :func:`write_reward` removes any reward file and writes the verdict.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import resource
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

#: Who runs the agent's code when the verifier is root: "nobody", not root and not the agent's user.
UNTRUSTED_UID = UNTRUSTED_GID = 65534
_PR_SET_DUMPABLE = 4
_PR_SET_CHILD_SUBREAPER = 36


class Refused(Exception):
    """A workspace file the verifier will not read (what it is, in words)."""


def read_file(name: str, limit: int) -> bytes:
    """The bytes of workspace file ``name`` (relative to the current directory), at most ``limit``.

    Raises :class:`Refused` when it is missing, not a regular file (a symlink, FIFO, device, directory)
    or larger than ``limit``. Never follows a symlink, never blocks on a FIFO, never reads past the limit.
    """
    try:
        st = os.lstat(name)
    except FileNotFoundError:
        raise Refused(f"{name} does not exist") from None
    except OSError as exc:
        raise Refused(f"{name} cannot be examined ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise Refused(f"{name} is not a regular file ({_kind(st.st_mode)})")
    try:
        # O_NOFOLLOW and O_NONBLOCK: had it been swapped for a link or a FIFO since lstat, the open
        # fails or returns at once instead of following it or waiting for a writer.
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise Refused(f"{name} cannot be opened ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{name} is not a regular file ({_kind(st.st_mode)})")
        if st.st_size > limit:
            raise Refused(f"{name} is {st.st_size} bytes, more than the {limit} this task allows")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(65536, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise Refused(f"{name} holds more than the {limit} bytes this task allows")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return f"mode {mode:o}"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(data: bytes) -> Any:
    """``data`` as strict JSON (UTF-8; no NaN or Infinity; no number that overflows a float).

    Raises ``ValueError`` for anything else (too deep included)."""
    try:
        value = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("nested too deep") from None
    return value


def number(value: Any) -> float | None:
    """``value`` as a float when it is a JSON number (an int or float, not a bool) that is finite and
    of sane size, else ``None``."""
    if type(value) is int:
        return float(value) if abs(value) < 2**63 else None
    if type(value) is float and math.isfinite(value):
        return value
    return None


def short(value: Any, limit: int = 120) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass
class Run:
    """What one run of the agent's code gave: its stdout (``None`` when it failed) and what went wrong."""

    stdout: bytes | None
    error: str | None
    stderr_tail: str
    isolation: str


def _prctl(option: int, arg: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(option, arg, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def _children() -> list[int]:
    """The processes whose parent is this one (orphans of the agent's code land here: subreaper)."""
    me, found = os.getpid(), list[int]()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 1 and int(fields[1]) == me:
            found.append(int(entry))
    return found


def _kill_everything_left(pgid: int, deadline: float) -> bool:
    """Kill the agent code's process group and every descendant, however detached (they are
    re-parented to this subreaper), and reap them. Whether none is left."""
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)
    while True:
        for pid in _children():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        try:
            while os.waitpid(-1, os.WNOHANG)[0] != 0:
                pass
        except ChildProcessError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def _limits(cpu_seconds: int, memory: int) -> None:
    """Resource limits of the agent code's process (runs in the child before exec)."""
    for which, value in ((resource.RLIMIT_CPU, cpu_seconds), (resource.RLIMIT_AS, memory),
                         (resource.RLIMIT_FSIZE, 16 << 20), (resource.RLIMIT_CORE, 0),
                         (resource.RLIMIT_NPROC, 256), (resource.RLIMIT_NOFILE, 256)):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(which, (value, value))


def _others_may_run(path: str) -> bool:
    """Whether a user that is neither owner nor group may execute ``path`` (every directory above it
    searchable by others): a python3 under /root (pyenv) is not."""
    real = os.path.realpath(path)
    try:
        if not os.stat(real).st_mode & stat.S_IXOTH or not stat.S_ISREG(os.stat(real).st_mode):
            return False
        d = os.path.dirname(real)
        while True:
            if not os.stat(d).st_mode & stat.S_IXOTH:
                return False
            if d == "/":
                return True
            d = os.path.dirname(d)
    except OSError:
        return False


def interpreter(for_others: bool) -> str | None:
    """The python3 to run the agent's code with: this one, else the system's, that the untrusted user
    may run (``for_others``), else ``None``."""
    candidates = [sys.executable, shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or "",
                  "/usr/bin/python3"]
    for path in candidates:
        if path and os.path.isabs(path) and (not for_others or _others_may_run(path)):
            return path
    return None


def _close_tests_dir() -> None:
    """Make the verifier's own directory unreadable to others (root keeps reading it)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    with contextlib.suppress(OSError):
        if os.stat(tests).st_uid == 0:
            os.chmod(tests, 0o700)


def run_untrusted(files: dict[str, bytes], script: str, *, timeout: float = 20.0,
                  output_limit: int = 1 << 20, memory: int = 1 << 30) -> Run:
    """Run ``python3 -I -B script`` in a private directory holding ``files`` (name -> bytes).

    As uid/gid 65534 with no supplementary groups when this verifier is root; otherwise (a local
    sandbox that is not hardened) as this verifier's own user, still in a process of its own, and
    :attr:`Run.isolation` says so. The environment is ``PATH``, ``HOME`` (the private directory) and
    ``LANG``; stdin is empty; stdout beyond ``output_limit`` bytes or a run past ``timeout`` seconds
    fails the run. Every process it started is killed before this returns.
    """
    _prctl(_PR_SET_DUMPABLE, 0)  # not ptrace-able, /proc/<pid> not readable, by the agent's code
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    root = os.geteuid() == 0
    if root:
        _close_tests_dir()
        who: dict[str, Any] = {"user": UNTRUSTED_UID, "group": UNTRUSTED_GID, "extra_groups": []}
        isolation = f"the agent's code ran as uid {UNTRUSTED_UID} in its own process"
    else:
        who = {}
        isolation = (
            f"the verifier is not root: the agent's code ran as this verifier's own uid {os.geteuid()}, "
            "in its own process but not isolated from the verifier (use a hardened sandbox)")
    work = tempfile.mkdtemp(prefix="ares-grade-")
    try:
        for name, data in files.items():
            fd = os.open(os.path.join(work, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                         0o644)
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
        os.chmod(work, 0o755)  # readable, not writable, by the agent's code
        python = interpreter(root)
        if python is None:
            return Run(None, f"no python3 here that uid {UNTRUSTED_UID} may run", "", isolation)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "LANG": "C.UTF-8"}
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                [python, "-I", "-B", script], cwd=work, env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, close_fds=True,
                preexec_fn=lambda: _limits(int(timeout) + 1, memory), **who,
            )
        except OSError as exc:
            return Run(None, f"the agent's code could not be started: {exc}", "", isolation)
        out, err, error = _collect(proc, started + timeout, output_limit)
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            code = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        if not _kill_everything_left(proc.pid, time.monotonic() + 5):
            error = error or "processes the agent's code started could not all be killed"
        stderr_tail = err[-2000:].decode("utf-8", "replace")
        if error is None and code != 0:
            error = f"the agent's code exited with code {code}"
        return Run(None if error else out, error, stderr_tail, isolation)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _collect(proc: subprocess.Popen[bytes], deadline: float, limit: int) -> tuple[bytes, bytes, str | None]:
    """Read stdout (at most ``limit`` bytes) and stderr (its last 64 KiB) until both close or ``deadline``
    (or, once the process has exited, half a second more: a process it left may hold them open)."""
    assert proc.stdout is not None and proc.stderr is not None
    out, err = bytearray(), bytearray()
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, out)
    sel.register(proc.stderr, selectors.EVENT_READ, err)
    error = None
    try:
        while sel.get_map() and error is None:
            if proc.poll() is not None:
                deadline = min(deadline, time.monotonic() + 0.5)
            left = deadline - time.monotonic()
            if left <= 0:
                error = ("the agent's code did not finish in time" if proc.poll() is None
                         else "the agent's code left a process holding its output open")
                break
            for key, _ in sel.select(min(left, 0.1)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = key.data
                buf += chunk
                if buf is out and len(out) > limit:
                    error = f"the agent's code printed more than {limit} bytes"
                    break
                if buf is err and len(err) > 65536:
                    del err[:-65536]
    finally:
        sel.close()
        proc.stdout.close()
        proc.stderr.close()
    return bytes(out), bytes(err), error


def write_reward(verifier_dir: str, name: str, text: str) -> None:
    """Write the verdict as ``verifier_dir/name`` (reward.txt or reward.json), removing any reward
    file already there first (reward.json would win over a reward.txt)."""
    for old in ("reward.json", "reward.txt"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(verifier_dir, old))
    fd = os.open(os.path.join(verifier_dir, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                 0o644)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
