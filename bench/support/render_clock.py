"""The seconds the tito policy spends rendering prompts (``TokenStreams.prepare``, run in worker threads),
summed while a bench runs: part of the gateway's own time in the training benches."""

from __future__ import annotations

import threading
import time
from typing import Any


class RenderClock:
    """Wraps ``TokenStreams.prepare`` until :meth:`close`; :attr:`seconds` is the time spent in it."""

    def __init__(self) -> None:
        from ares_gateway.tokens import streams

        self.seconds = 0.0
        self._lock = threading.Lock()
        self._cls = streams.TokenStreams
        self._real = real = self._cls.prepare

        def timed_prepare(streams_self: Any, *a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real(streams_self, *a, **k)
            finally:
                with self._lock:
                    self.seconds += time.perf_counter() - t0

        self._cls.prepare = timed_prepare  # type: ignore[method-assign]

    def close(self) -> None:
        """Put the real ``prepare`` back."""
        self._cls.prepare = self._real  # type: ignore[method-assign]
