"""Stat trackers: scalars per step to nowhere, to the log, or to TensorBoard event files.

>>> tracker = make_tracker("tensorboard", logdir="runs/x", period=10.0)
>>> tracker.log(3, **{"episode/reward": 1.0, "episode/turns": 12})
>>> tracker.close()

Every tracker buffers and writes at most every ``period`` seconds (``0`` writes on every ``log``);
``flush()`` writes now. Trackers flush and close at interpreter exit, so a run stopped by Ctrl-C or
an exception still leaves its last scalars on disk. Tag names may contain ``/`` (TensorBoard groups
by the part before it): pass them as ``**{"episode/reward": r}``.

TensorBoard files are written with ``tensorboardX``'s record writer (no torch or TensorFlow needed).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger(__name__)


@runtime_checkable
class StatTracker(Protocol):
    """Where run statistics go."""

    def log(self, step: int, **scalars: float) -> None:
        """Record named scalars at ``step`` (``None`` values are skipped)."""
        ...

    def flush(self) -> None:
        """Write everything buffered now."""
        ...

    def close(self) -> None:
        """Flush and release; later ``log`` calls are ignored. Idempotent."""
        ...


def _clean(step: int, scalars: Mapping[str, Any]) -> dict[str, float]:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise TypeError(f"step must be a non-negative int, got {step!r}")
    out: dict[str, float] = {}
    for name, value in scalars.items():
        if value is None:
            continue
        if isinstance(value, bool):
            value = int(value)
        if not isinstance(value, int | float):
            raise TypeError(f"stat {name!r} must be a number, got {type(value).__name__} {value!r}")
        out[name] = float(value)
    return out


class NullTracker:
    """Records nothing."""

    def log(self, step: int, **scalars: float) -> None:
        _clean(step, scalars)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Buffered:
    """Shared machinery: a lock, a buffer of (step, scalars), a period, and flush-at-exit.

    The exit hook is a :func:`weakref.finalize` on the tracker: it runs at interpreter exit (or when
    the tracker is collected) without keeping the tracker alive, and ``close()`` disarms it.
    """

    def __init__(self, period: float) -> None:
        if period < 0 or not math.isfinite(period):
            raise ValueError(f"period must be a finite number of seconds >= 0, got {period!r}")
        self.period = period
        self._lock = threading.Lock()
        self._buffer: list[tuple[int, dict[str, float], float]] = []
        self._last_write = time.monotonic()
        self._closed = False
        # The finalizer holds the sink, never self.
        self._finalizer = weakref.finalize(self, self._exit_hook(), self._buffer, self._lock)

    def _exit_hook(self) -> Any:
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        return self._closed

    def log(self, step: int, **scalars: float) -> None:
        values = _clean(step, scalars)
        if self._closed or not values:
            return
        with self._lock:
            self._buffer.append((step, values, time.time()))
            due = time.monotonic() - self._last_write >= self.period
        if due:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            items = list(self._buffer)
            self._buffer.clear()
            self._last_write = time.monotonic()
            self._write(items)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        self.flush()
        self._release()

    def _write(self, items: list[tuple[int, dict[str, float], float]]) -> None:
        raise NotImplementedError

    def _release(self) -> None:
        pass


class LoggingTracker(_Buffered):
    """Writes one log line per flush: per tag, the mean of its values since the last line, and the last step.

    With ``period=0`` every ``log`` call is its own line.
    """

    def __init__(self, *, logger: logging.Logger | None = None, level: int = logging.INFO,
                 period: float = 30.0) -> None:
        self.logger = logger or logging.getLogger("ares_gateway.episodes.stats")
        self.level = level
        super().__init__(period)

    def _exit_hook(self) -> Any:
        logger, level = self.logger, self.level

        def hook(buffer: list[tuple[int, dict[str, float], float]], lock: threading.Lock) -> None:
            with lock:
                line = _summary_line(buffer)
                buffer.clear()
            if line:
                logger.log(level, "%s", line)

        return hook

    def _write(self, items: list[tuple[int, dict[str, float], float]]) -> None:
        line = _summary_line(items)
        if line:
            self.logger.log(self.level, "%s", line)


def _summary_line(items: Iterable[tuple[int, dict[str, float], float]]) -> str:
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    last_step = -1
    for step, values, _ in items:
        last_step = max(last_step, step)
        for k, v in values.items():
            sums[k] = sums.get(k, 0.0) + v
            counts[k] = counts.get(k, 0) + 1
    if not sums:
        return ""
    parts = []
    for k in sorted(sums):
        mean = sums[k] / counts[k]
        parts.append(f"{k}={mean:.6g}" + (f" (mean of {counts[k]})" if counts[k] > 1 else ""))
    return f"step {last_step}: " + ", ".join(parts)


_SEQ = itertools.count(1)


class TensorBoardTracker(_Buffered):
    """Writes TensorBoard event files into ``logdir`` (one scalar series per tag).

    ``period`` seconds between writes to disk (default 10). Events are written synchronously with
    tensorboardX's record writer: ``SummaryWriter.flush()`` does not wait for its background queue,
    so it could not honour "flush means on disk" (at exit in particular).
    """

    def __init__(self, logdir: str | Path, *, period: float = 10.0) -> None:
        try:
            from tensorboardX.event_file_writer import EventsWriter
        except ImportError as exc:  # pragma: no cover - depends on the installation
            raise ImportError(
                "the TensorBoard tracker needs tensorboardX: pip install tensorboardX (or use the "
                "'logging' tracker)"
            ) from exc
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        # The file name holds the time in seconds and the host; the pid and a counter keep two trackers
        # started in the same second from writing (and truncating) the same file.
        self._writer = EventsWriter(str(self.logdir / "events"), f".{os.getpid()}.{next(_SEQ)}")
        super().__init__(period)

    @property
    def path(self) -> Path:
        """The event file."""
        return Path(self._writer._file_name)

    def _exit_hook(self) -> Any:
        writer = self._writer

        def hook(buffer: list[tuple[int, dict[str, float], float]], lock: threading.Lock) -> None:
            with lock:
                _write_scalars(writer, buffer)
                buffer.clear()
            writer.close()

        return hook

    def _write(self, items: list[tuple[int, dict[str, float], float]]) -> None:
        _write_scalars(self._writer, items)

    def _release(self) -> None:
        self._writer.close()


def _write_scalars(writer: Any, items: list[tuple[int, dict[str, float], float]]) -> None:
    if not items:
        return
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.summary import scalar

    for step, values, walltime in items:
        for tag, value in values.items():
            writer.write_event(Event(wall_time=walltime, step=step, summary=scalar(tag, value)))
    writer.flush()


class MultiTracker:
    """Fans every call out to several trackers."""

    def __init__(self, *trackers: StatTracker) -> None:
        self.trackers = list(trackers)

    def log(self, step: int, **scalars: float) -> None:
        for t in self.trackers:
            t.log(step, **scalars)

    def flush(self) -> None:
        for t in self.trackers:
            t.flush()

    def close(self) -> None:
        for t in self.trackers:
            t.close()


TRACKERS = ("null", "logging", "tensorboard")


def make_tracker(kind: str, *, logdir: str | Path | None = None, period: float | None = None) -> StatTracker:
    """``null``, ``logging`` or ``tensorboard`` (needs ``logdir``); ``period`` in seconds (each kind has a
    default)."""
    if kind == "null":
        return NullTracker()
    if kind == "logging":
        return LoggingTracker() if period is None else LoggingTracker(period=period)
    if kind == "tensorboard":
        if logdir is None:
            raise ValueError("the tensorboard tracker needs logdir= (a directory for the event files)")
        return TensorBoardTracker(logdir) if period is None else TensorBoardTracker(logdir, period=period)
    raise ValueError(f"unknown stat tracker {kind!r}: use one of {', '.join(TRACKERS)}")
