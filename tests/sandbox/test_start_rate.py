"""The cap on how fast sandboxes start (sandbox.start_rate): real local sandboxes started at once,
timed where each one's creation began."""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import time
from pathlib import Path

import pytest

import sandbox
from sandbox import start_rate
from sandbox.local import LocalSandbox, local_root
from tests.helpers import cli, left_behind


@pytest.fixture(autouse=True)
def _no_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no limit in force and the environment's unread."""
    monkeypatch.delenv(start_rate.ENV_VAR, raising=False)
    monkeypatch.setattr(start_rate, "_rates", None)
    start_rate._buckets.clear()


async def _creation_times(n: int) -> list[float]:
    """Start ``n`` local sandboxes at once; the moment each began creating (its ``_start``)."""
    began: list[float] = []

    class Timed(LocalSandbox):
        async def _start(self) -> None:
            began.append(time.monotonic())
            # Let the others that may start now record their moment before this one's synchronous
            # set-up holds the loop (on a loaded machine it would delay theirs, not the limit).
            await asyncio.sleep(0)
            await super()._start()

    boxes = [Timed(sandbox.SandboxSpec()) for _ in range(n)]
    try:
        await asyncio.gather(*(b.start() for b in boxes))
    finally:
        await asyncio.gather(*(b.stop() for b in boxes))
    assert not left_behind(local_root()), "a sandbox was left behind"
    return sorted(began)


def test_starts_are_spaced_by_the_rate(sandbox_root: Path) -> None:
    sandbox.limit_start_rate(10.0)
    began = asyncio.run(_creation_times(5))
    gaps = [b - a for a, b in itertools.pairwise(began)]
    # aiolimiter's leaky bucket: the first at once, then one each 0.1 s (a little slack for the clock).
    assert min(gaps) >= 0.08, gaps
    assert began[-1] - began[0] >= 0.35


def test_a_burst_starts_at_once_then_the_rate_holds(sandbox_root: Path) -> None:
    sandbox.limit_start_rate(5.0, burst=3)
    began = asyncio.run(_creation_times(4))
    assert began[2] - began[0] < 0.15, began  # the burst of 3
    assert began[3] - began[0] >= 0.15, began  # the fourth waits for the bucket to drain


def test_without_a_limit_nothing_waits(sandbox_root: Path) -> None:
    began = asyncio.run(_creation_times(5))
    assert began[-1] - began[0] < 0.3, began


def test_a_limit_for_another_backend_does_not_slow_this_one(sandbox_root: Path) -> None:
    sandbox.limit_start_rate(0.5, backend="daytona")
    began = asyncio.run(_creation_times(3))
    assert began[-1] - began[0] < 0.3, began
    assert start_rate.start_rates() == {"daytona": (0.5, 1)}
    sandbox.limit_start_rate(None, backend="daytona")
    assert start_rate.start_rates() == {}


def test_the_environment_sets_the_rate(monkeypatch: pytest.MonkeyPatch, sandbox_root: Path) -> None:
    monkeypatch.setenv(start_rate.ENV_VAR, "10")
    assert start_rate.start_rates() == {None: (10.0, 1)}
    began = asyncio.run(_creation_times(3))
    assert began[-1] - began[0] >= 0.15


@pytest.mark.parametrize("bad", ["0", "-1", "fast", "nan", "inf"])
def test_a_bad_environment_value_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    monkeypatch.setenv(start_rate.ENV_VAR, bad)
    with pytest.raises(ValueError, match=f"{start_rate.ENV_VAR}=.*positive number of sandboxes a second"):
        start_rate.start_rates()


@pytest.mark.parametrize(("rate", "burst"), [(0, 1), (-2.0, 1), (float("nan"), 1), (True, 1), (1.0, 0),
                                             (1.0, 1.5)])
def test_bad_limits_are_refused(rate: float, burst: int) -> None:
    with pytest.raises(ValueError, match=r"start rate|burst"):
        sandbox.limit_start_rate(rate, burst=burst)
    assert start_rate.start_rates() == {}


def test_the_run_command_refuses_a_bad_rate() -> None:
    env = {k: v for k, v in os.environ.items() if k != start_rate.ENV_VAR}
    r = subprocess.run(cli("run", "examples", "--policy", "oracle", "--start-rate", "0"), env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--start-rate" in r.stderr and "positive number of sandboxes a second" in r.stderr


def test_the_ray_executor_gives_each_node_the_rate() -> None:
    from ares_gateway.episodes.ray import with_start_rate

    assert with_start_rate({"working_dir": "x"}) == {"working_dir": "x"}  # no limit: nothing added
    sandbox.limit_start_rate(2.5)
    got = with_start_rate({"working_dir": "x", "env_vars": {"A": "1"}})
    assert got == {"working_dir": "x", "env_vars": {"A": "1", start_rate.ENV_VAR: "2.5"}}
    mine = with_start_rate({"env_vars": {start_rate.ENV_VAR: "1"}})  # the caller's own value wins
    assert mine["env_vars"][start_rate.ENV_VAR] == "1"
    sandbox.limit_start_rate(None)
    sandbox.limit_start_rate(1.0, backend="modal")  # a backend's own limit stays in this process
    assert "env_vars" not in with_start_rate({})
