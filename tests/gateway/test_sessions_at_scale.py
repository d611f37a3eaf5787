"""Two thousand sessions on one gateway, each with its own connection, lose nothing.

bench/bench_sessions.py at a size CI can hold, as a test of correctness, not speed: the real
``ares-gateway serve`` (uvloop, durable recording) started under a soft open-file limit of 1024, as on
many Linux machines, with no flag raised for the size; 2,048 sessions created over the control API; one
turn from each at once (2,048 requests parked together, one client connection each) then 2,048 more
paced; two pollers answering through /poll and /respond. Every request gets its answer and every turn
is in its session's count.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import bench_sessions  # noqa: E402

SESSIONS = 2048


def test_two_thousand_sessions_lose_no_turn_under_a_low_open_file_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < SESSIONS + 1536:
        pytest.skip(f"the hard open-file limit ({hard}) is below the {SESSIONS + 1536} this needs")
    out = bench_sessions.run_case(SESSIONS, "small", measured=SESSIONS, rate=1000.0,
                                  gateway_soft_nofile=1024)
    assert out["gateway_exit"] is None, "the gateway exited during the run"
    assert out["errors"] == 0, out["first_errors"]
    assert out["turns"] == 2 * SESSIONS
    assert out["recorded"] == 2 * SESSIONS
    assert out["lost"] == 0


def test_the_twenty_kilobyte_body_is_what_the_bench_says() -> None:
    body = bench_sessions.body_bytes("20k")
    assert 18_000 <= len(body) <= 24_000
    with pytest.raises(ValueError, match="unknown body"):
        bench_sessions.body_bytes("huge")
