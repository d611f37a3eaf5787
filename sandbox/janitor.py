"""Never lose a sandbox.

* Every started sandbox registers here; on normal exit (atexit), on an uncaught exception (which ends
  in a normal exit), on SIGINT and on SIGTERM, every sandbox still registered is removed with its
  synchronous :meth:`stop_and_remove`.  The previous signal handlers are chained, so Ctrl-C still
  raises ``KeyboardInterrupt`` and SIGTERM still terminates.
* Every sandbox carries owner labels: ``ares-gateway.owner`` (``host:pid:process-start-time``),
  ``ares-gateway.session`` (random per process) and ``ares-gateway.created`` (unix time).  While the
  process has sandboxes, a daemon thread touches a heartbeat file for its session.
* :func:`sandbox.gc.collect_garbage` (``ares-gateway gc``) removes sandboxes whose owner is gone: on this host
  the owner pid is checked together with its start time (pid reuse cannot fool it); for an owner on
  another host, the heartbeat decides when a shared heartbeat directory is visible, else the sandbox
  is left alone.  Live owners' sandboxes are never touched.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

OWNER_LABEL = "ares-gateway.owner"
SESSION_LABEL = "ares-gateway.session"
CREATED_LABEL = "ares-gateway.created"
SANDBOX_LABEL = "ares-gateway.sandbox"

HEARTBEAT_INTERVAL = 10.0
DEFAULT_STALE_AFTER = 60.0


class _Removable(Protocol):
    id: str

    def stop_and_remove(self) -> None: ...


_registry: dict[int, _Removable] = {}
_registry_lock = threading.RLock()
_installed_pid: int | None = None
_session: tuple[int, str] | None = None
_heartbeat_thread: threading.Thread | None = None
_heartbeat_stop = threading.Event()


def _proc_start_time(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22), or ``None``
    when there is no such process or it has exited: a zombie (state ``Z``/``X``) is dead, though its pid
    stays taken until it is reaped, which never happens under an init that does not reap orphans (a
    container's PID 1, a killed Ray raylet's workers)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read().decode(errors="replace")
    except OSError:
        return None
    # The command name may contain spaces and parentheses: fields start after the last ')'.
    rest = data[data.rfind(")") + 2 :].split()
    if len(rest) <= 19 or rest[0] in ("Z", "X"):
        return None
    return rest[19]


def session_id() -> str:
    """Random id of this process (a forked child gets a new one)."""
    global _session
    pid = os.getpid()
    if _session is None or _session[0] != pid:
        _session = (pid, uuid.uuid4().hex[:16])
    return _session[1]


def owner_id(pid: int | None = None) -> str:
    pid = pid or os.getpid()
    return f"{socket.gethostname()}:{pid}:{_proc_start_time(pid) or '0'}"


def owner_labels() -> dict[str, str]:
    return {OWNER_LABEL: owner_id(), SESSION_LABEL: session_id()}


def state_dir() -> Path:
    """Where heartbeats (and local sandboxes' owner files) live: ``$ARES_SANDBOX_STATE_DIR`` or
    ~/.local/state."""
    env = os.environ.get("ARES_SANDBOX_STATE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "ares-gateway"


def _heartbeat_path(session: str) -> Path:
    return state_dir() / "heartbeats" / f"{session}.json"


def _beat() -> None:
    path = _heartbeat_path(session_id())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"owner": owner_id(), "time": time.time()}))
        os.replace(tmp, path)
    except OSError:
        pass


def _heartbeat_loop() -> None:
    while not _heartbeat_stop.wait(HEARTBEAT_INTERVAL):
        _beat()


def _ensure_heartbeat() -> None:
    global _heartbeat_thread
    _beat()
    if _heartbeat_thread is None or not _heartbeat_thread.is_alive():
        _heartbeat_stop.clear()
        _heartbeat_thread = threading.Thread(target=_heartbeat_loop, name="sandbox-heartbeat", daemon=True)
        _heartbeat_thread.start()


def _make_handler(signum: int, previous: Any) -> Callable[[int, FrameType | None], None]:
    def handler(sig: int, frame: FrameType | None) -> None:
        cleanup_all(reason=signal.Signals(sig).name)
        if callable(previous):
            previous(sig, frame)
        elif previous == signal.SIG_IGN:
            return
        else:  # SIG_DFL (or unknown): restore and re-raise so the process dies of this signal.
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)

    handler.__ares_janitor__ = True  # type: ignore[attr-defined]
    return handler


def install() -> None:
    """Hook atexit and SIGINT/SIGTERM (only from the main thread; atexit alone otherwise). Idempotent."""
    global _installed_pid
    if _installed_pid == os.getpid():
        return
    _installed_pid = os.getpid()
    atexit.register(cleanup_all, reason="exit")
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous = signal.getsignal(signum)
            if getattr(previous, "__ares_janitor__", False):
                continue
            try:
                signal.signal(signum, _make_handler(signum, previous))
            except (ValueError, OSError):  # not allowed here (embedded interpreter, ...)
                pass


def register(sandbox: _Removable) -> None:
    install()
    with _registry_lock:
        _registry[id(sandbox)] = sandbox
    _ensure_heartbeat()


def unregister(sandbox: _Removable) -> None:
    with _registry_lock:
        _registry.pop(id(sandbox), None)


def live_sandboxes() -> list[_Removable]:
    with _registry_lock:
        return list(_registry.values())


def cleanup_all(reason: str = "cleanup") -> int:
    """Remove every sandbox this process still holds; returns how many were removed."""
    removed = 0
    for sandbox in live_sandboxes():
        try:
            sandbox.stop_and_remove()
            removed += 1
        except Exception as exc:  # keep going: one failure must not leak the others
            print(f"sandbox janitor ({reason}): could not remove {sandbox.id}: {exc}", file=sys.stderr)
        finally:
            unregister(sandbox)
    if reason == "exit":
        _heartbeat_stop.set()
        try:
            _heartbeat_path(session_id()).unlink(missing_ok=True)
        except OSError:
            pass
    return removed


# -- garbage collection ---------------------------------------------------------------------------


def owner_status(labels: dict[str, str], *, stale_after: float = DEFAULT_STALE_AFTER) -> str:
    """``alive``, ``dead`` or ``unknown`` for the owner named by a sandbox's labels."""
    owner = labels.get(OWNER_LABEL, "")
    parts = owner.rsplit(":", 2)
    if len(parts) != 3:
        return "unknown"
    host, pid_text, start = parts
    if host == socket.gethostname():
        try:
            pid = int(pid_text)
        except ValueError:
            return "unknown"
        current = _proc_start_time(pid)
        if current is None:
            return "dead"
        return "alive" if current == start or start == "0" else "dead"
    session = labels.get(SESSION_LABEL)
    if not session:
        return "unknown"
    path = _heartbeat_path(session)
    try:
        age = time.time() - path.stat().st_mtime
    except OSError:
        return "unknown"
    return "alive" if age <= stale_after else "dead"
