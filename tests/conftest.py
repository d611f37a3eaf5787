"""Suite-wide set-up: every async test runs on uvloop, the loop the CLI uses (``ares_gateway.cli``).

``ARES_TEST_LOOP=asyncio`` runs the suite on the standard loop instead. A test where the two loops
differ in what matters (subprocesses, sockets) runs on both with
``@pytest.mark.asyncio(loop_factories=["uvloop", "asyncio"])``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import uvloop

# Ray (the scale tests; verl imports it) reads this when first imported: with it off, Ray takes
# 127.0.0.1 as every node's address instead of the machine's own (which the network rules forbid).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# A node's raylet may take longer than Ray's 30 s to register on 2 busy cores (seen here under load).
os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "uvloop": uvloop.new_event_loop,
    "asyncio": asyncio.new_event_loop,
}
DEFAULT_LOOP = os.environ.get("ARES_TEST_LOOP", "uvloop")
if DEFAULT_LOOP not in LOOPS:
    raise pytest.UsageError(f"ARES_TEST_LOOP={DEFAULT_LOOP!r}: choose one of {', '.join(LOOPS)}")


def pytest_asyncio_loop_factories(config: pytest.Config, item: Any) -> Mapping[str, Callable[[], Any]]:
    marker = item.get_closest_marker("asyncio")
    asked = marker.kwargs.get("loop_factories") if marker is not None else None
    if asked:
        return {name: LOOPS[name] for name in asked if name in LOOPS}
    return {DEFAULT_LOOP: LOOPS[DEFAULT_LOOP]}


@pytest.fixture
def sandbox_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private root for local sandboxes, so a test can see that none is left behind. Set in the
    environment before anything starts: sandboxes, agents and Ray workers started after inherit it."""
    root = tmp_path / "sandboxes"
    monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(root))
    return root
