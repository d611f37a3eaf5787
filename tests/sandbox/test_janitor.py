"""The janitor removes every sandbox on exit, exception, SIGINT and SIGTERM; gc reaps only dead owners."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from sandbox import janitor

from .conftest import container_exists, docker_required

CHILD = Path(__file__).parent / "janitor_child.py"
REPO = Path(__file__).resolve().parents[2]


def _spawn(mode: str, backends: str, env: dict[str, str]) -> tuple[subprocess.Popen[str],
                                                                   list[dict[str, Any]]]:
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), mode, backends], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env, cwd=str(REPO),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(30)
        raise AssertionError(f"child failed: {proc.stderr.read() if proc.stderr else ''}")
    return proc, json.loads(line)


def _tagged_processes(sandbox_id: str) -> list[int]:
    needle = f"ARES_SANDBOX_ID={sandbox_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as fh:
                    if needle in fh.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                continue
    return found


def _gone(item: dict[str, Any]) -> bool:
    if item["backend"] == "local":
        return not Path(item["root"]).exists() and not _tagged_processes(item["id"])
    return not container_exists(item["container"])


def _wait_gone(items: list[dict[str, Any]], timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_gone(item) for item in items):
            return True
        time.sleep(0.2)
    return False


@pytest.fixture
def child_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["ARES_SANDBOX_LOCAL_ROOT"] = str(tmp_path / "local")
    env["ARES_SANDBOX_STATE_DIR"] = str(tmp_path / "state")
    env["PYTHONPATH"] = str(REPO)
    return env


@pytest.mark.parametrize("backend", ["local", pytest.param("docker", marks=pytest.mark.docker)])
@pytest.mark.parametrize("how", ["exit", "exception", "SIGINT", "SIGTERM"])
def test_janitor_removes_everything(backend: str, how: str, child_env: dict[str, str]) -> None:
    mode = {"exit": "exit", "exception": "exception"}.get(how, "wait")
    proc, items = _spawn(mode, backend, child_env)
    assert items and not any(_gone(item) for item in items), "the sandboxes should exist while the child runs"
    if how.startswith("SIG"):
        proc.send_signal(getattr(signal, how))
    code = proc.wait(60)
    stderr = proc.stderr.read() if proc.stderr else ""
    if how == "exception":
        assert code == 1 and "boom" in stderr
    elif how == "SIGTERM":
        assert code == -signal.SIGTERM, stderr
    elif how == "SIGINT":
        assert code != 0 and "KeyboardInterrupt" in stderr, stderr
    else:
        assert code == 0, stderr
    assert _wait_gone(items), f"sandboxes left behind after {how}: {items}"


def test_gc_reaps_exactly_the_sigkilled_owners_sandboxes(child_env: dict[str, str]) -> None:
    docker_required()
    victim, victim_items = _spawn("wait", "docker,docker,local", child_env)
    survivor, survivor_items = _spawn("wait", "docker,local", child_env)
    try:
        victim.send_signal(signal.SIGKILL)
        assert victim.wait(30) == -signal.SIGKILL
        # SIGKILL leaves no chance to clean up: the victim's containers are still there.
        assert all(container_exists(i["container"]) for i in victim_items if i["backend"] == "docker")
        gc = subprocess.run(
            [sys.executable, "-m", "ares_gateway.cli", "gc"], capture_output=True, text=True, env=child_env,
            cwd=str(REPO), timeout=120,
        )
        assert gc.returncode == 0, gc.stdout + gc.stderr
        removed = {line.split()[1] for line in gc.stdout.splitlines() if line.startswith("removed ")}
        for item in victim_items:
            ref = f"docker:{item['container'][:12]}" if item["backend"] == "docker" else f"local:{item['id']}"
            assert ref in removed, gc.stdout
        assert _wait_gone(victim_items), "gc left the dead owner's sandboxes behind"
        # The live process's sandboxes are untouched, and gc says it kept them.
        for item in survivor_items:
            assert not _gone(item), f"gc removed a live owner's sandbox: {item}"
            ref = f"docker:{item['container'][:12]}" if item["backend"] == "docker" else f"local:{item['id']}"
            assert ref not in removed and f"kept {ref}" in gc.stdout
        # Nothing removed belonged to a live process.
        for line in gc.stdout.splitlines():
            if line.startswith("removed docker:"):
                labels = _container_labels(line.split()[1].split(":", 1)[1])
                assert labels is None or janitor.owner_status(labels) == "dead"
    finally:
        survivor.send_signal(signal.SIGTERM)
        survivor.wait(60)
    assert _wait_gone(survivor_items)


def _container_labels(ref: str) -> dict[str, str] | None:
    import docker as docker_sdk

    client = docker_sdk.from_env()
    try:
        return dict(client.containers.get(ref).labels)
    except docker_sdk.errors.NotFound:
        return None
    finally:
        client.close()


def test_owner_status_sees_through_pid_reuse() -> None:
    me = janitor.owner_labels()
    assert janitor.owner_status(me) == "alive"
    host, pid, start = me[janitor.OWNER_LABEL].rsplit(":", 2)
    reused = {**me, janitor.OWNER_LABEL: f"{host}:{pid}:{int(start) + 1}"}
    assert janitor.owner_status(reused) == "dead"
    assert janitor.owner_status({janitor.OWNER_LABEL: f"{host}:999999999:1"}) == "dead"
    assert janitor.owner_status(
        {janitor.OWNER_LABEL: "other-host:1:1", janitor.SESSION_LABEL: "x"}) == "unknown"


def test_an_owner_that_exited_but_was_never_reaped_is_dead() -> None:
    # Under a container's PID 1 that reaps no orphans (and for a killed Ray raylet's workers), a dead
    # owner stays a zombie with its pid and start time: gc must still see it gone (CI once left a
    # removed node's sandbox behind this way).
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    try:
        labels = {janitor.OWNER_LABEL: janitor.owner_id(child.pid)}
        assert janitor.owner_status(labels) == "alive"
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the child never exited"
            time.sleep(0.05)
        assert janitor.owner_status(labels) == "dead"  # not reaped yet: its /proc entry is still there
    finally:
        child.wait()
