"""Resource limits at the episode level: an agent that takes more than its sandbox allows ends its
episode with a named exit reason (``memory_limit``, ``pids_limit``, ``disk_limit``) and reward 0.0, and the
host is
fine. Played by the real mini-swe-agent with the scripted policy (the agent's own commands) on the
hardened local backend and on Docker.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ares_gateway import Gateway
from ares_gateway.episodes.episode import (
    DEFAULT_RESOURCES,
    harness_side_call_detector,
    with_default_resources,
)
from ares_gateway.episodes.tasks import Task
from sandbox import Resources
from tests.rollouts.e2e import require_mini
from tests.security.test_exploits import HONEST, _run, task_dir

pytestmark = [pytest.mark.slow]

# 1.5 GiB touched page by page in a sandbox of 256 MiB.
EAT_MEMORY = ("python3 -c \"b = bytearray(1536 * 2**20); b[::4096] = b'x' * len(b[::4096]); "
              "print('survived')\"")
# A bounded fork bomb: 1,500 sleepers (20 s each: the agent's command waits for them) against the
# default 1,024 pids (Python's fork fails at once; bash would retry each refused fork with a back-off).
FORK_MANY = ("python3 -c 'import os, time\nfor i in range(1500):\n    try:\n        pid = os.fork()\n"
             "    except OSError:\n        print(\"refused at\", i); break\n    if pid == 0:\n"
             "        time.sleep(20); os._exit(0)'")
# 5 GB into a sandbox of 100 MB.
FILL_DISK = "dd if=/dev/zero of=big.bin bs=1M count=5000 2>&1 | tail -n 2; true"


def make_task(root: Path, name: str, memory_mb: int | None = None, storage_mb: int | None = None) -> Task:
    env = "[environment]\n" + (f"memory_mb = {memory_mb}\n" if memory_mb else "") + (
        f"storage_mb = {storage_mb}\n" if storage_mb else "")
    return Task.load(task_dir(root, name, workspace=True, toml_extra=env, test_sh=(
        '#!/bin/sh\nif [ "$(cat /workspace/answer.txt 2>/dev/null)" = "42" ]; then v=1; else v=0; fi\n'
        'echo $v > "$ARES_VERIFIER_DIR/reward.txt"\n'
    )))


def test_default_resources_fill_only_what_the_task_leaves_open() -> None:
    assert with_default_resources(Resources()) == DEFAULT_RESOURCES
    mine = with_default_resources(Resources(memory="256m", cpus=1.0))
    assert (mine.memory, mine.cpus, mine.pids, mine.disk) == ("256m", 1.0, DEFAULT_RESOURCES.pids,
                                                              DEFAULT_RESOURCES.disk)
    docker = with_default_resources(Resources(), "docker")
    assert (docker.memory, docker.pids, docker.disk) == (DEFAULT_RESOURCES.memory, DEFAULT_RESOURCES.pids,
                                                         None)
    assert with_default_resources(Resources(disk="1g"), "docker").disk == "1g"


@pytest.mark.parametrize("backend", ["local", "docker"])
async def test_limits_end_the_episode_by_name(backend: str, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    require_mini(backend)
    monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(tmp_path / "sandboxes"))
    greedy = make_task(tmp_path / "tasks", "greedy", memory_mb=256)
    forker = make_task(tmp_path / "tasks", "forker")
    filler = make_task(tmp_path / "tasks", "filler", storage_mb=100)
    honest = make_task(tmp_path / "tasks", "honest", memory_mb=256)
    async with Gateway(port=0, request_timeout=300,
                       side_call_detector=harness_side_call_detector("mini-swe-agent")) as gw:
        ate, forked, filled, solved = await asyncio.gather(
            _run(gw, greedy, [EAT_MEMORY, HONEST], backend, tmp_path / "greedy"),
            _run(gw, forker, [FORK_MANY, HONEST], backend, tmp_path / "forker"),
            _run(gw, filler, [FILL_DISK, HONEST], backend, tmp_path / "filler"),
            _run(gw, honest, [HONEST], backend, tmp_path / "honest"),
        )
    [e] = ate.episodes
    assert (e.exit_reason, e.reward) == ("memory_limit", 0.0), (e.exit_reason, e.error)
    assert "memory limit (256m)" in (e.error or "")
    [e] = forked.episodes
    assert (e.exit_reason, e.reward) == ("pids_limit", 0.0), (e.exit_reason, e.error)
    [e] = filled.episodes
    assert (e.exit_reason, e.reward) == ("disk_limit", 0.0), (e.exit_reason, e.error)
    assert "disk limit (100m)" in (e.error or "")
    # Within its limits the same agent is scored as ever.
    [e] = solved.episodes
    assert (e.exit_reason, e.reward) == ("completed", 1.0), (e.exit_reason, e.error)
