"""``run --ray ADDRESS`` and ``gc --ray ADDRESS`` with an address where no Ray cluster answers.

Ray's own connect loop retries such an address for many minutes and says nothing; the command must
instead fail within its connect timeout with one line naming the address, exit code 2, before anything
is written. Every address here is on loopback: a closed port, a port that accepts and never answers, a
port that answers as something other than Ray's GCS. ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps Ray's
own address resolution on 127.0.0.1 too.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import cli, free_port
from tests.prereq import require
from tests.rollouts.e2e import REPO

TIMEOUT_S = 3.0
# Starting the interpreter and importing Ray takes a few seconds on this machine.
START_SLACK_S = 30.0


@pytest.fixture(autouse=True)
def _need_ray() -> None:
    require(importlib.util.find_spec("ray") is not None,
            "needs the ray extra: python3 -m pip install -e '.[ray]'")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return {**env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONUNBUFFERED": "1"}


@contextlib.contextmanager
def _silent_listener() -> Iterator[int]:
    """A loopback port whose connections are accepted by the kernel (the backlog) and never answered."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield int(s.getsockname()[1])


@contextlib.contextmanager
def _http1_listener() -> Iterator[int]:
    """A loopback port answering every connection as an HTTP/1.1 server would (Ray's dashboard, say)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                with contextlib.suppress(OSError):
                    conn.recv(1024)
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield int(srv.getsockname()[1])
    finally:
        stop.set()
        t.join(5)
        srv.close()


def _run(argv: list[str], limit: float = TIMEOUT_S) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    try:
        proc = subprocess.run(cli(*argv), cwd=REPO, env=_env(), capture_output=True, text=True,
                              timeout=limit + START_SLACK_S + 30)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{argv}: still connecting after {exc.timeout:.0f} s, silently") from exc
    return proc, time.monotonic() - started


def _assert_one_line(proc: subprocess.CompletedProcess[str], elapsed: float, address: str, why: str,
                     limit: float = TIMEOUT_S) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"ares-gateway: error: cannot reach the Ray cluster at {address} within "
                               f"{limit:g} s: "), lines[0]
    assert why in lines[0] and "Traceback" not in proc.stderr, lines[0]
    assert elapsed < limit + START_SLACK_S, elapsed


def _run_argv(address: str, out: Path, timeout: float | None = TIMEOUT_S) -> list[str]:
    flag = [] if timeout is None else ["--ray-connect-timeout", f"{timeout:g}"]
    return ["run", "examples-tiny", "--policy", "oracle", "--sandbox", "local", "--stats", "null",
            "--ray", address, *flag, "--out", str(out)]


def test_run_on_a_closed_loopback_port_fails_in_one_line(tmp_path: Path) -> None:
    from ares_gateway.episodes.ray import CONNECT_TIMEOUT

    address = f"127.0.0.1:{free_port()}"
    proc, elapsed = _run(_run_argv(address, tmp_path / "out", None), CONNECT_TIMEOUT)  # the default timeout
    _assert_one_line(proc, elapsed, address, "connection refused", CONNECT_TIMEOUT)
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


def test_run_on_a_port_that_never_answers_fails_after_its_timeout(tmp_path: Path) -> None:
    with _silent_listener() as port:
        address = f"127.0.0.1:{port}"
        proc, elapsed = _run(_run_argv(address, tmp_path / "out"))
    _assert_one_line(proc, elapsed, address, "did not answer")
    assert elapsed >= TIMEOUT_S  # it waited its timeout, no longer (above)


def test_run_on_a_port_that_is_not_rays_fails_in_one_line(tmp_path: Path) -> None:
    with _http1_listener() as port:
        address = f"127.0.0.1:{port}"
        proc, elapsed = _run(_run_argv(address, tmp_path / "out"))
    _assert_one_line(proc, elapsed, address, "not as a Ray cluster's GCS")


def test_gc_on_a_closed_loopback_port_fails_in_one_line() -> None:
    address = f"127.0.0.1:{free_port()}"
    proc, elapsed = _run(["gc", "--ray", address, "--backend", "local", "--dry-run"])
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"cannot reach the Ray cluster at {address} within" in lines[0], proc.stderr
    assert elapsed < 20 + START_SLACK_S


def test_bad_connect_timeouts_are_refused(tmp_path: Path) -> None:
    for value in ("0", "-1", "nan", "inf"):
        proc, _ = _run([*_run_argv("127.0.0.1:1", tmp_path / "out", None), "--ray-connect-timeout", value])
        assert proc.returncode == 2 and "--ray-connect-timeout" in proc.stderr, (value, proc.stderr)
    from ares_gateway.episodes.ray import RayExecutor

    with pytest.raises(ValueError, match="connect_timeout"):
        RayExecutor("127.0.0.1:1", connect_timeout=0)
