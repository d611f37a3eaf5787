"""``kill_processes()`` on the local backend kills every process the sandbox
started, whatever namespace it made (a nested user + PID namespace from ``unshare -Urpf`` escapes a
PID-namespace walk and could rewrite the workspace during verification).

Real processes, real namespaces, real cgroups: hardened bubblewrap sandboxes, as root.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path

import pytest

import sandbox
from sandbox import SandboxSpec
from sandbox.local import LocalSandbox
from tests.prereq import require_hardened_local


def _host_pids(needle: str, *, exact: bool = False) -> list[int]:
    """Host processes whose command line contains (or with ``exact``: is) ``needle``, in any namespace."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0",
                                                                          b" ").decode(errors="replace")
            state = Path(f"/proc/{entry}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if ((cmdline.strip() == needle if exact else needle in cmdline) and state not in (b"Z", b"X")
            and int(entry) != os.getpid()):
            found.append(int(entry))
    return found


async def _wait_for(needle: str, count: int = 1, timeout: float = 20.0, *, exact: bool = False) -> list[int]:
    deadline = asyncio.get_running_loop().time() + timeout
    while len(pids := _host_pids(needle, exact=exact)) < count:
        assert asyncio.get_running_loop().time() < deadline, f"{needle!r} never started"
        await asyncio.sleep(0.05)
    return pids


def _cgroup_procs(sb: LocalSandbox) -> list[int] | None:
    """What the sandbox's command cgroups list (host PIDs), or None where it has none."""
    group = sb._cgroup
    if group is None:
        return None
    return sorted(group.members("cmds"))


@pytest.fixture
def local_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    require_hardened_local()
    root = tmp_path / "sandboxes"
    monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(root))
    return root


async def test_kill_processes_reaches_a_nested_user_and_pid_namespace(local_root: Path) -> None:
    tag = str(900000 + secrets.randbelow(90000))
    # Not hardened: there the seccomp filter refuses the new user namespace outright (and root lacks
    # CAP_SYS_ADMIN for a bare PID one; test_hostile_local checks both). Here root may make one, so
    # this shows the kill itself reaches it: the cgroup, not the PID namespace, says who is in the sandbox.
    spec = SandboxSpec(hardened=False, network="none")
    async with sandbox.create(spec, backend="local") as sb:
        assert isinstance(sb, LocalSandbox)
        # The escape: a new user and PID namespace, detached, rewriting a file.
        loop = (f"setsid unshare -Urpf sh -c 'while :; do echo forged > /workspace/out.txt; "
                f"sleep {tag}.5 & wait; done' >/dev/null 2>&1 </dev/null &")
        started = await sb.exec(loop, timeout=30)
        assert started.ok, started
        # The sleep itself (its shell and unshare name it too, and may be seen before it starts).
        [pid] = await _wait_for(f"sleep {tag}.5", exact=True)
        ns = os.readlink(f"/proc/{pid}/ns/pid")
        assert ns != os.readlink(f"/proc/{os.getpid()}/ns/pid")
        killed = await sb.kill_processes(timeout=20)
        assert killed >= 2  # the namespace's init (sh) and its sleep at least
        assert _host_pids(
            f"sleep {tag}.5") == [], "a process in a nested PID namespace survived kill_processes()"
        assert _host_pids(f"sleep {tag}.5 & wait") == []
        assert _cgroup_procs(sb) in (None, [])
        # Nothing rewrites the workspace any more, and the sandbox still works for the verifier.
        assert (await sb.exec(
            "rm -f /workspace/out.txt; sleep 0.3; cat /workspace/out.txt 2>/dev/null || echo gone",
            timeout=30)).stdout.strip() == "gone"
        assert await sb.kill_processes() == 0


async def test_kill_processes_of_the_agent_user_reaches_its_nested_namespace(local_root: Path) -> None:
    """As the agent user (where the kernel lets it make a user namespace): only its processes die."""
    tag = str(800000 + secrets.randbelow(90000))
    spec = SandboxSpec(hardened=True, network="none")
    async with sandbox.create(spec, backend="local") as sb:
        probe = await sb.exec("unshare -Urpf true", user="agent", timeout=30)
        if not probe.ok:
            pytest.skip("the agent user cannot make a user namespace here (seccomp or sysctl): "
                        f"{probe.stderr.strip()}")
        await sb.exec(f"setsid unshare -Urpf sleep {tag}.25 >/dev/null 2>&1 </dev/null &",
                      user="agent", timeout=30)
        await sb.exec(f"setsid sleep {tag}.75 >/dev/null 2>&1 </dev/null &", timeout=30)
        await _wait_for(f"sleep {tag}.25")
        await _wait_for(f"sleep {tag}.75")
        assert await sb.kill_processes(user="agent", timeout=20) >= 1
        assert _host_pids(f"sleep {tag}.25") == []
        assert len(_host_pids(f"sleep {tag}.75")) == 1  # root's process is not the agent's
        await sb.kill_processes(timeout=20)
        assert _host_pids(f"sleep {tag}.75") == []


async def test_stop_kills_a_nested_namespace_and_leaves_no_cgroup(local_root: Path) -> None:
    tag = str(700000 + secrets.randbelow(90000))
    sb = sandbox.create(SandboxSpec(hardened=False, network="none"), backend="local")  # see the first test
    assert isinstance(sb, LocalSandbox)
    await sb.start()
    try:
        await sb.exec(f"setsid unshare -Urpf sleep {tag}.5 >/dev/null 2>&1 </dev/null &", timeout=30)
        await _wait_for(f"sleep {tag}.5")
        dirs = list(sb._cgroup.dirs) if sb._cgroup is not None else []
    finally:
        await sb.stop()
    assert _host_pids(f"sleep {tag}.5") == []
    assert all(not d.exists() for d in dirs), dirs
    assert not (local_root / sb.id).exists()


# The forging loops of test_exploits, each in a nested user + PID namespace, which a walk of the
# sandbox's PID namespace alone would never see.
NESTED_FORGE_LOOP = (
    "setsid nohup unshare -Urpf sh -c 'while :; do for d in /logs/verifier "
    "/tmp/ares-task-*/logs/verifier; do mkdir -p $d 2>/dev/null; echo \"{\\\"tests\\\": 1.0}\" > "
    "$d/reward.json 2>/dev/null; echo 1 > $d/reward.txt 2>/dev/null; done; sleep 0.02; done' >/dev/null 2>&1 "
    "< /dev/null & echo started"
)
# Once the verifier uploads /tests (root's, readable), copy the hidden tests out and
# write the answer into the workspace while test.sh runs.
NESTED_CHEAT = (
    "setsid nohup unshare -Urpf sh -c 'while :; do if [ -f /tests/test.sh ]; then "
    "cp /tests/test.sh /workspace/stolen-test.sh 2>/dev/null; echo 42 > /workspace/answer.txt; fi; "
    "sleep 0.01; done' >/dev/null 2>&1 < /dev/null & echo started"
)


@pytest.mark.slow
async def test_an_agents_nested_namespace_loops_are_killed_before_the_tests(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real episode (mini-swe-agent, scripted policy): the agent leaves loops in nested namespaces
    that forge the reward and, once the tests are uploaded, copy them and write the answer: reward 0."""
    require_hardened_local()
    from ares_gateway import Gateway
    from ares_gateway.episodes.episode import harness_side_call_detector
    from tests.rollouts.e2e import require_mini
    from tests.security.test_exploits import _run, make_task

    require_mini("local")
    monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(tmp_path / "sandboxes"))
    marker = "ARES-TASK-" + secrets.token_hex(8)
    forge = make_task(tmp_path / "tasks", "forge", marker)
    honest = make_task(tmp_path / "tasks", "honest", marker)
    probe = "unshare -Urpf true && echo NESTED-OK || echo NESTED-REFUSED"
    async with Gateway(port=0, request_timeout=300,
                       side_call_detector=harness_side_call_detector("mini-swe-agent")) as gw:
        forged, solved = await asyncio.gather(
            _run(gw, forge, [probe, NESTED_FORGE_LOOP, NESTED_CHEAT], "local", tmp_path / "forge"),
            _run(gw, honest, ["echo 42 > answer.txt", NESTED_FORGE_LOOP], "local", tmp_path / "honest"),
        )
    for summary in (forged, solved):
        [e] = summary.episodes
        assert e.exit_reason == "completed", (e.task, e.exit_reason, e.error)
    assert forged.episodes[0].reward == 0.0
    assert solved.episodes[0].reward == 1.0
    assert _host_pids("unshare -Urpf sh -c") == []
