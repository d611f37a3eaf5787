"""How fast sandboxes may be started, for providers that rate-limit creation.

A cloud provider refuses (or queues, or bills) a burst of creations: a run of thousands of episodes
asks for a sandbox per episode as fast as its slots free up. :func:`limit_start_rate` caps the
creations of one backend (or of every backend) at ``per_second`` with bursts of up to ``burst``;
:meth:`BaseSandbox.start <sandbox.protocol.BaseSandbox.start>` waits its turn before it creates
anything. The bucket is aiolimiter's ``AsyncLimiter`` (a leaky bucket), one per event loop, so the
cap holds per process: a run on N Ray nodes starts up to N times the rate.

Without a call, the environment decides: ``ARES_SANDBOX_START_RATE`` (sandboxes a second, every
backend), read at the first start, so child processes and Ray workers started with it inherit it.
"""

from __future__ import annotations

import asyncio
import math
import os
import weakref

from aiolimiter import AsyncLimiter

#: Sandboxes a second (every backend) when :func:`limit_start_rate` was not called.
ENV_VAR = "ARES_SANDBOX_START_RATE"

#: backend (``None``: every backend) -> (per_second, burst); ``None`` until set or read from the environment.
_rates: dict[str | None, tuple[float, int]] | None = None
_buckets: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str | None, AsyncLimiter]] = (
    weakref.WeakKeyDictionary())


def _check(per_second: float, burst: int) -> None:
    if isinstance(per_second, bool) or not (isinstance(per_second, int | float) and math.isfinite(per_second)
                                            and per_second > 0):
        raise ValueError(f"a start rate must be a positive number of sandboxes a second, got {per_second!r}")
    if not isinstance(burst, int) or burst < 1:
        raise ValueError(f"burst must be a positive whole number of sandboxes, got {burst!r}")


def _from_env() -> dict[str | None, tuple[float, int]]:
    raw = os.environ.get(ENV_VAR, "").strip()
    if not raw:
        return {}
    try:
        rate = float(raw)
        _check(rate, 1)
    except ValueError:
        raise ValueError(f"{ENV_VAR}={raw!r}: set it to a positive number of sandboxes a second") from None
    return {None: (rate, 1)}


def limit_start_rate(per_second: float | None, *, backend: str | None = None, burst: int = 1) -> None:
    """Start at most ``per_second`` sandboxes a second (of ``backend``, or of every backend with
    ``None``), letting up to ``burst`` start at once after a quiet spell; ``per_second=None`` lifts
    that limit. A backend's own limit and the all-backends one both apply. Takes effect for starts
    that have not begun waiting."""
    global _rates
    if _rates is None:
        _rates = _from_env()
    if per_second is None:
        _rates.pop(backend, None)
    else:
        _check(per_second, burst)
        _rates[backend] = (float(per_second), burst)
    _buckets.clear()


def start_rates() -> dict[str | None, tuple[float, int]]:
    """The limits in force: backend (``None``: every backend) -> (sandboxes a second, burst)."""
    global _rates
    if _rates is None:
        _rates = _from_env()
    return dict(_rates)


async def wait_to_start(backend: str) -> None:
    """Return when ``backend`` may start one more sandbox under the limits in force (at once without
    any)."""
    rates = start_rates()
    if not rates:
        return
    buckets = _buckets.setdefault(asyncio.get_running_loop(), {})
    for key in (None, backend):
        limit = rates.get(key)
        if limit is None:
            continue
        bucket = buckets.get(key)
        if bucket is None:
            per_second, burst = limit
            bucket = buckets[key] = AsyncLimiter(burst, burst / per_second)
        await bucket.acquire()


__all__ = ["ENV_VAR", "limit_start_rate", "start_rates", "wait_to_start"]
