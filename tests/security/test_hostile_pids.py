"""Root never acts on what the agent wrote: pid files, exit codes and the records root kills (or spares) by.

What a hostile agent tries, each replayed here against real sandboxes:

* Docker: a command's pid file written by the command's own shell (as the agent, for the agent's
  commands) would let the agent name the relay that carries its session as the pid root kills on a
  timeout or a cancellation (and let its own timed-out command escape the kill): the pid files root
  kills by are root's.
* The harness's poll (``kill -0 $(cat $STATE/pid)``, ``cat $STATE/exit_code``) reads root's records,
  never the agent's directory, where a FIFO at ``$STATE/pid`` would block the poll until it timed out
  and an ``exit_code`` of the agent's would mark the run "completed" while the agent still ran.
* ``kill_processes()`` spares a relay by pid and start time, so an agent process that takes a dead
  relay's pid does not run on through the verifier.
* Local: ``kill_processes()`` does not raise when the sandbox's keeper is gone (OOM-killed), and a
  keeper that cannot be spared from the OOM killer (no CAP_SYS_RESOURCE) is a warning.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sandbox import DockerSandbox, SandboxSpec
from tests.prereq import require_hardened_local
from tests.rollouts.e2e import AGENT_BASE_IMAGE as BASE_IMAGE
from tests.rollouts.e2e import require_agent_base

PORT = 18080
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
async def host_socket(tmp_path: Path) -> AsyncIterator[str]:
    """A host unix socket that answers each connection with one line (what the relay forwards to)."""
    path = str(tmp_path / "sock" / "gw.sock")
    os.makedirs(os.path.dirname(path))

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"gateway\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(on_conn, path)
    try:
        yield path
    finally:
        server.close()
        await server.wait_closed()


async def _relay(sb: DockerSandbox) -> tuple[int, str]:
    """The relay's pid (from its pid file) and its command line, read as root."""
    r = await sb.exec(f"p=$(cat /.ares/relay-{PORT}.pid); echo $p; tr '\\0' ' ' </proc/$p/cmdline",
                      user="root", cwd="/", timeout=30)
    pid, _, cmdline = r.stdout.partition("\n")
    return int(pid), cmdline


# The agent's command: write the relay's pid into every pid file it owns (its own command's among
# them, where the sandbox put that in a directory the agent can write), then stay.
_NAME_THE_RELAY = (
    f"r=$(cat /.ares/relay-{PORT}.pid); n=0; for f in /tmp/.ares-exec-*.pid /.ares/exec/*.pid; do "
    "[ -O \"$f\" ] && echo $r >\"$f\" && n=$((n+1)); done; echo named $n; sleep {tag}"
)


@pytest.mark.docker
@pytest.mark.parametrize("tunnel", ["mount", "exec"])
async def test_docker_a_pid_file_naming_the_relay_never_gets_it_killed(tunnel: str, host_socket: str) -> None:
    """A timed-out and a cancelled command of the agent's: root kills the command, not the relay."""
    require_agent_base()
    tag = str(4000 + secrets.randbelow(1000))
    spec = SandboxSpec(image=BASE_IMAGE, network="none", forwards={PORT: host_socket})
    async with DockerSandbox(spec, tunnel=tunnel) as sb:
        before = await _relay(sb)
        assert "/.ares/relay.py" in before[1], before
        r = await sb.exec(_NAME_THE_RELAY.format(tag=f"{tag}.1"), user="agent", timeout=3)
        assert r.timed_out, r
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(sb.exec(_NAME_THE_RELAY.format(tag=f"{tag}.2"), user="agent", timeout=60),
                                   3)
        await asyncio.sleep(0.5)
        assert await _relay(sb) == before  # the very same relay, alive
        left = await sb.exec(f"ps -eo args | grep -c '^sleep {tag}' || true", user="root", cwd="/",
                             timeout=30)
        assert left.stdout.strip() == "0", left  # and the agent's own commands did not escape their kill
        got = await sb.exec(["python3", "-c", "import socket; s = socket.create_connection(('127.0.0.1', "
                             f"{PORT}), 5); print(s.recv(100).decode().strip())"], user="agent", timeout=30)
        assert got.stdout.strip() == "gateway", got


@pytest.mark.docker
@pytest.mark.parametrize("how", ["start time", "owner"])
async def test_docker_a_relay_record_naming_another_process_spares_nothing(how: str,
                                                                           host_socket: str) -> None:
    """The pid a dead relay's files still name, taken by an agent process (as pid reuse would have it):
    kill_processes() kills it.  The record differs from that process by its start time, or (when the
    start time is the agent process's own) by its owner."""
    require_agent_base()
    tag = str(5000 + secrets.randbelow(1000))
    spec = SandboxSpec(image=BASE_IMAGE, network="none", forwards={PORT: host_socket})
    async with DockerSandbox(spec) as sb:
        relay, _ = await _relay(sb)
        started = await sb.exec(f"setsid sleep {tag} >/dev/null 2>&1 </dev/null & echo $!", user="agent",
                                timeout=30)
        agent_pid = int(started.stdout.strip())
        stat = await sb.exec(f"cat /proc/{agent_pid}/stat /proc/{relay}/stat", user="root", cwd="/",
                             timeout=30)
        agent_start, relay_start = (line.rsplit(")", 1)[1].split()[19] for line in stat.stdout.splitlines())
        start = relay_start if how == "start time" else agent_start
        # The relay dies; its records stay and now name the agent's process.
        forged = await sb.exec(f"kill -9 {relay}; echo {agent_pid} >/.ares/relay-{PORT}.pid; "
                               f"echo '{agent_pid} {start}' >/.ares/relay-{PORT}.id", user="root", cwd="/",
                               timeout=30)
        assert forged.ok, forged
        await sb.kill_processes(timeout=20)
        left = await sb.exec(f"[ -d /proc/{agent_pid} ] && cat /proc/{agent_pid}/cmdline || echo gone",
                             user="root", cwd="/", timeout=30)
        assert left.stdout.strip() == "gone", left


@pytest.mark.docker
async def test_docker_root_steps_and_records_are_out_of_the_agents_reach() -> None:
    """Where root keeps its records: a directory of root's that the agent can neither list nor write."""
    require_agent_base()
    async with DockerSandbox(SandboxSpec(image=BASE_IMAGE, network="none")) as sb:
        r = await sb.exec("ls /.ares/exec 2>&1; touch /.ares/exec/x 2>&1; id -u", user="agent", timeout=30)
        assert "Permission denied" in r.stdout and r.stdout.strip().endswith("1000"), r
        # The agent's own environment reaches its command, never root's steps before the switch.
        r = await sb.exec('printf "%s|%s|%s" "$(id -u)" "$FOO" "$HOME"', user="agent",
                          env={"FOO": "a 'b' \"c\""}, timeout=30)
        assert r.stdout == "1000|a 'b' \"c\"|/home/agent", r


# -- the harness's own polling, in a real episode -------------------------------------------------

# A hostile agent: a FIFO where a harness reading the agent's pid would block until it timed out, a
# loop naming the relay in every pid file it owns (for root to kill the relay), and, once that is
# done, an exit code of its own, which would record the run "completed" at once, the agent's real
# work (the answer, written after) never seen.
_FIFO_AND_NAME = (
    "st=$(ls -d $HOME/.ares/mini-swe-agent/*/ | head -n 1); rm -f $st/pid; mkfifo $st/pid; "
    "setsid nohup sh -c 'while :; do r=$(cat /.ares/relay-*.pid 2>/dev/null | head -n 1); "
    "for f in /tmp/.ares-exec-*.pid /.ares/exec/*.pid; do [ -O \"$f\" ] && echo $r >\"$f\"; done; sleep "
    "0.05; done' >/dev/null 2>&1 </dev/null & ls -la $st"
)
_FORGE_EXIT = ("sleep 40; st=$(ls -d $HOME/.ares/mini-swe-agent/*/ | head -n 1); echo 0 > "
               "$st/exit_code; ls $st")
_HONEST = "echo 42 > answer.txt"


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.parametrize("tunnel", ["mount", "exec"])
async def test_a_fifo_and_a_forged_exit_code_in_the_state_directory_change_nothing(
        tunnel: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ares_gateway import Gateway
    from ares_gateway.episodes.episode import harness_side_call_detector
    from ares_gateway.episodes.tasks import Task
    from tests.rollouts.e2e import require_mini
    from tests.security.test_exploits import _run, task_dir

    require_mini("docker")
    monkeypatch.setenv("ARES_DOCKER_TUNNEL", tunnel)
    task = Task.load(task_dir(tmp_path / "tasks", "fifo", solve_sh=f"#!/bin/sh\n{_HONEST}\n", test_sh=(
        "#!/bin/sh\nv=0; [ \"$(cat /workspace/answer.txt 2>/dev/null)\" = 42 ] && v=1\n"
        'echo $v > "$ARES_VERIFIER_DIR/reward.txt"\n')))
    async with Gateway(port=0, request_timeout=300,
                       side_call_detector=harness_side_call_detector("mini-swe-agent")) as gw:
        summary = await _run(gw, task, [_FIFO_AND_NAME, _FORGE_EXIT, _HONEST], "docker", tmp_path / "out")
    [e] = summary.episodes
    # The agent's session outlived its attacks (the relay was never killed), the run ended when the
    # agent did (not at the forged exit code), and its last command's answer was graded.
    assert e.exit_reason == "completed", (e.exit_reason, e.error)
    assert e.reward == 1.0, (e.reward, e.error)


# -- local: kill_processes() with its keeper gone, and a keeper it could not spare from the OOM killer ---


async def test_local_kill_processes_with_its_keeper_gone_does_not_raise(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_hardened_local()
    import sandbox
    from sandbox import Resources
    from sandbox.local import LocalSandbox

    monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(tmp_path / "sandboxes"))
    tag = str(600000 + secrets.randbelow(90000))
    spec = SandboxSpec(hardened=True, network="none", resources=Resources(memory="512m"))
    async with sandbox.create(spec, backend="local") as sb:
        assert isinstance(sb, LocalSandbox) and sb._ns_pid is not None
        await sb.exec(f"setsid sleep {tag} >/dev/null 2>&1 </dev/null &", user="agent", timeout=30)
        os.kill(sb._ns_pid, 9)  # as the OOM killer would
        for _ in range(100):
            if not await asyncio.to_thread(os.path.exists, f"/proc/{sb._ns_pid}"):
                break
            await asyncio.sleep(0.05)
        assert await sb.kill_processes(timeout=20) >= 0
        assert await sb.kill_processes(user="agent", timeout=20) >= 0


_NO_SYS_RESOURCE = textwrap.dedent("""
    import asyncio, logging, sys
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="LOG %(levelname)s %(message)s")
    import sandbox
    from sandbox import Resources, SandboxSpec

    async def main():
        spec = SandboxSpec(hardened=True, network="none", resources=Resources(memory="512m"))
        async with sandbox.create(spec, backend="local") as sb:
            print("DESCRIPTION", sb.description)
            print("KILLED", await sb.kill_processes(timeout=20))

    asyncio.run(main())
""")


def test_local_keeper_not_spared_from_the_oom_killer_is_said(tmp_path: Path) -> None:
    """Root without CAP_SYS_RESOURCE (a container that drops it) cannot lower oom_score_adj: the sandbox
    says so (a warning and its description), and still works."""
    require_hardened_local()
    from sandbox import _cgroup

    if _cgroup.layout() is None or _cgroup.layout().memory is None:  # type: ignore[union-attr]
        pytest.skip("no memory cgroup here: the keeper is spared only where memory is limited")
    env = {**os.environ, "ARES_SANDBOX_LOCAL_ROOT": str(tmp_path / "sandboxes"), "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        ["setpriv", "--bounding-set=-sys_resource", "--inh-caps=-sys_resource", sys.executable,
         "-c", _NO_SYS_RESOURCE], capture_output=True, text=True, timeout=120, env=env, cwd=REPO,
        check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "KILLED 0" in out, out[-3000:]
    warnings = [line for line in out.splitlines() if line.startswith("LOG WARNING") and "OOM" in line]
    assert warnings, out[-3000:]
    assert "CAP_SYS_RESOURCE" in warnings[0], warnings
    description = next(line for line in out.splitlines() if line.startswith("DESCRIPTION"))
    assert "OOM killer" in description, description
