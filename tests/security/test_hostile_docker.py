"""Docker backend: a hostile agent against the root steps and the host's resources.

* An agent that plants programs named like the system's own (``tr``, ``chmod``, ``bash``,
  ``python3``...) in the directories it can write and that were on the image's PATH
  (``~/.local/bin``, ``~/.npm-global/bin``) must not get them run by root: not by
  ``kill_processes()``, the verifier's seal step or ``test.sh``. Played by a real agent
  (mini-swe-agent with the scripted policy, as in ``test_exploits.py``).
* The limits of ``spec.resources`` are enforced by the kernel and reported by ``limits_reached()``:
  a bounded fork bomb is refused (pids), a process touching more than the memory limit is
  OOM-killed (memory), a write beyond the disk limit finds the writable layer full (disk).
* The kernel keyring is refused inside containers (Docker's default seccomp profile).
"""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path

import pytest

import sandbox
from ares_gateway import Gateway
from ares_gateway.episodes.episode import harness_side_call_detector
from ares_gateway.episodes.tasks import Task
from sandbox import DockerSandbox, Resources, SandboxSpec, janitor
from sandbox.docker import DEFAULT_PIDS
from tests.rollouts.e2e import AGENT_BASE_IMAGE as BASE_IMAGE
from tests.rollouts.e2e import require_agent_base, require_mini
from tests.security.test_exploits import HONEST, _run, _verifier_log, task_dir

pytestmark = [pytest.mark.docker]


#: Names the backend's root steps, the harness's root steps and the verifier call, and more.
PLANTED = ("tr grep sort head tail cat cut chmod chown mkdir rm ls touch id setsid sleep sh bash dash "
           "python3 python env mv cp useradd").split()

# Each fake notes who ran it, forges the reward where root can write it, then runs the real program
# (so every step still works and nothing but the forgery gives the plant away).  The fake calls only
# absolute paths: it must not find itself.
_FAKE = r"""#!/bin/sh
n=${0##*/}
/usr/bin/printf '%s %s\n' "$(/usr/bin/id -u)" "$n" >>/tmp/ares-planted.log 2>/dev/null
if [ "$(/usr/bin/id -u)" = 0 ]; then
  /usr/bin/printf '%s\n' "uid0 $n" >>/tmp/ares-pwned-by-root 2>/dev/null
  /usr/bin/mkdir -p /logs/verifier 2>/dev/null
  /usr/bin/printf '{"tests": 1.0}\n' >/logs/verifier/reward.json 2>/dev/null
fi
for d in /usr/local/sbin /usr/local/bin /usr/sbin /usr/bin /sbin /bin; do
  [ -x "$d/$n" ] && exec "$d/$n" "$@"
done
exit 127
"""


def _plant_command() -> str:
    """The agent's own command: write the fake once and link it under every planted name, in both dirs."""
    names = " ".join(PLANTED)
    return (
        "for d in $HOME/.local/bin $HOME/.npm-global/bin; do mkdir -p $d && "
        f"printf %s {_shquote(_FAKE)} > $d/.fake && chmod 755 $d/.fake && "
        f"for n in {names}; do ln -sf $d/.fake $d/$n; done; done; "
        "touch /tmp/ares-planted.log; chmod 666 /tmp/ares-planted.log; ls $HOME/.local/bin | wc -l"
    )


def _shquote(s: str) -> str:
    import shlex

    return shlex.quote(s)


def _make_task(root: Path, name: str) -> Task:
    # Builtins only while reporting, so that (were root to find the plant) the report itself is not the
    # plant's.
    return Task.load(task_dir(root, name, solve_sh=f"#!/bin/sh\n{HONEST}\n", test_sh=(
        "#!/bin/sh\n"
        "echo '--- pwned'; [ -f /tmp/ares-pwned-by-root ] && while read -r l; do echo \"PWNED $l\"; done "
        "</tmp/ares-pwned-by-root; echo '--- end pwned'\n"
        "echo \"PATH-OF-TEST $PATH\"\n"
        "v=0; [ -f /workspace/answer.txt ] && read -r a </workspace/answer.txt && [ \"$a\" = 42 ] && v=1\n"
        'echo $v > "$ARES_VERIFIER_DIR/reward.txt"\n'
    )))


@pytest.mark.slow
async def test_planted_system_programs_never_run_as_root(tmp_path: Path) -> None:
    require_mini("docker")
    plant = _plant_command()
    # A command of the agent's that runs a planted program itself (uid 1000: allowed, it is its own).
    own = "cat /etc/hostname >/dev/null; tr a b </dev/null; true"
    forge = _make_task(tmp_path / "tasks", "plant-forge")
    honest = _make_task(tmp_path / "tasks", "plant-honest")
    control = _make_task(tmp_path / "tasks", "control")
    async with Gateway(port=0, admin_token="admin-" + secrets.token_urlsafe(24), request_timeout=300,
                       side_call_detector=harness_side_call_detector("mini-swe-agent")) as gw:
        forged, planted_honest, controlled = await asyncio.gather(
            _run(gw, forge, [plant, own], "docker", tmp_path / "forge"),
            _run(gw, honest, [plant, own, HONEST], "docker", tmp_path / "honest"),
            _run(gw, control, [HONEST], "docker", tmp_path / "control"),
        )
    for summary in (forged, planted_honest, controlled):
        [e] = summary.episodes
        assert e.exit_reason == "completed", (e.task, e.exit_reason, e.error)
        assert e.error is None, (e.task, e.error)
    assert forged.episodes[0].reward == 0.0  # the forged reward.json was never written by root
    for task, out in ((forge, "forge"), (honest, "honest")):
        log = _verifier_log(tmp_path / out, task)
        assert "--- end pwned" in log, log[-2000:]
        assert [line for line in log.splitlines() if line.startswith("PWNED ")] == [], log[-2000:]
        path_line = next(line for line in log.splitlines() if line.startswith("PATH-OF-TEST "))
        assert "/home/" not in path_line and ".local" not in path_line, path_line
    assert planted_honest.episodes[0].reward == 1.0  # the plants change nothing for honest work
    assert controlled.episodes[0].reward == 1.0


async def test_root_steps_ignore_the_agents_path_and_python_env() -> None:
    """A root exec gets the system PATH, HOME=/root and no PYTHON*, whatever the caller, the spec or
    the image put there; the agent user keeps its own dirs on PATH."""
    require_agent_base()
    spec = SandboxSpec(image=BASE_IMAGE, network="none",
                       env={"PYTHONPATH": "/home/agent/evil", "PATH": "/home/agent/.local/bin:/usr/bin:/bin"})
    async with DockerSandbox(spec) as sb:
        r = await sb.exec('printf "%s|%s|%s|%s" "$PATH" "$HOME" "${PYTHONPATH-unset}" "$(id -u)"',
                          user="root",
                          env={"PYTHONSTARTUP": "/home/agent/x.py", "LD_PRELOAD": "/home/agent/x.so"})
        path, home, pythonpath, uid = r.stdout.split("|")
        assert uid == "0" and home == "/root" and pythonpath == "unset"
        assert "/home" not in path and path.endswith("/usr/bin:/sbin:/bin"), path
        leftover = await sb.exec("env | grep -E '^(PYTHON|LD_)' || true", user="root")
        assert leftover.stdout == "", leftover.stdout
        # A user name that is root under another name: the wrapper goes by the real uid.
        await sb.exec("useradd -o -u 0 -g 0 -M -d /root toor", user="root")
        r = await sb.exec('printf %s "$PATH"', user="toor")
        assert "/home" not in r.stdout, r.stdout
        # The agent user: its own env as given (it may shadow programs for itself).
        r = await sb.exec('printf "%s|%s" "$PATH" "${PYTHONPATH-unset}"', user="agent")
        assert r.stdout == "/home/agent/.local/bin:/usr/bin:/bin|/home/agent/evil", r.stdout
    async with DockerSandbox(SandboxSpec(image=BASE_IMAGE, network="none")) as sb:
        r = await sb.exec('printf %s "$PATH"', user="agent")
        # No PATH given: the user's own bin directories come first, then the system's.
        assert r.stdout.startswith(
            "/home/agent/.npm-global/bin:/home/agent/.local/bin:/usr/local/sbin"), r.stdout
        r = await sb.exec('printf %s "$PATH"', user="root")
        assert r.stdout == "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", r.stdout


async def test_kill_processes_and_file_steps_run_no_planted_program() -> None:
    """The backend's own root steps (kill_processes, uploads' mkdir/chown, the relay) with the
    agent's fakes planted under every name they could look up."""
    require_agent_base()
    async with DockerSandbox(SandboxSpec(image=BASE_IMAGE, network="none", user="agent")) as sb:
        planted = await sb.exec(_plant_command())
        assert planted.ok, planted.stderr
        await sb.exec("setsid sleep 300 >/dev/null 2>&1 </dev/null &")
        assert await sb.kill_processes(user="agent") >= 1
        assert await sb.kill_processes() >= 0
        here = Path(__file__)
        await sb.upload_file(here, "/workspace/sub/dir/copy.py")
        pwned = await sb.exec("cat /tmp/ares-pwned-by-root 2>/dev/null; ls /logs 2>/dev/null; true",
                              user="root")
        assert pwned.stdout == "", pwned.stdout


async def test_fork_bomb_is_refused_and_reported() -> None:
    require_agent_base()
    spec = SandboxSpec(image=BASE_IMAGE, network="none", resources=Resources(pids=64))
    async with DockerSandbox(spec) as sb:
        assert await sb.limits_reached() == frozenset()
        # Bounded: 300 sleepers, each gone after 60 s at the latest (and killed below).
        # Counted by builtins: with every pid taken, nothing more can be forked to count them.
        r = await sb.exec("( for i in $(seq 300); do sleep 60 & done ) 2>/dev/null; "
                          "n=0; for d in /proc/[0-9]*; do n=$((n+1)); done; echo $n", user="agent",
                          timeout=60)
        alive = int(r.stdout.strip().splitlines()[-1])
        assert alive <= 64, alive
        assert "pids" in await sb.limits_reached()
        assert await sb.kill_processes() >= 1  # the limit does not lock root out
        r = await sb.exec("cat /sys/fs/cgroup/pids/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids.max")
        assert r.stdout.strip() == "64"  # and is back after the kill
    host = await asyncio.create_subprocess_exec("true")  # the host still forks
    assert await host.wait() == 0


async def test_default_limits_apply_when_the_spec_gives_none() -> None:
    require_agent_base()
    async with DockerSandbox(SandboxSpec(image=BASE_IMAGE, network="none")) as sb:
        r = await sb.exec("cat /sys/fs/cgroup/pids/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids.max")
        assert r.stdout.strip() == str(DEFAULT_PIDS)
    async with DockerSandbox(SandboxSpec(image=BASE_IMAGE, network="none"), default_pids=None) as sb:
        r = await sb.exec("cat /sys/fs/cgroup/pids/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids.max")
        assert r.stdout.strip() == "max"


async def test_memory_hog_is_oom_killed_and_reported() -> None:
    require_agent_base()
    spec = SandboxSpec(image=BASE_IMAGE, network="none", resources=Resources(memory="256m"))
    async with DockerSandbox(spec) as sb:
        r = await sb.exec(
            "python3 -c \"b = bytearray(1536 << 20); b[::4096] = b'x' * len(b[::4096]); print('survived')\"",
            user="agent", timeout=120)
        assert "survived" not in r.stdout and r.exit_code == 137, (r.exit_code, r.stdout, r.stderr[-300:])
        assert "memory" in await sb.limits_reached()
        assert (await sb.exec("echo alive")).stdout == "alive\n"  # the container lives on


async def test_disk_limit_fills_the_writable_layer_and_is_reported() -> None:
    require_agent_base()
    spec = SandboxSpec(image=BASE_IMAGE, network="none", user="agent", resources=Resources(disk="64m"))
    async with DockerSandbox(spec) as sb:
        assert "disk" in sb.description
        assert await sb.limits_reached() == frozenset()
        # Everywhere the agent may write counts: the workdir, /tmp, its home.
        r = await sb.exec(
            "for d in /workspace /tmp $HOME; do dd if=/dev/zero of=$d/fill bs=1M count=40 2>&1; "
            "done; echo done", timeout=120)
        assert "No space left on device" in r.stdout, r.stdout
        assert "disk" in await sb.limits_reached()
        assert (await sb.exec("rm -f /workspace/fill /tmp/fill $HOME/fill && echo freed")).stdout == "freed\n"
        assert (await sb.exec("cat /etc/hostname")).ok  # the image's own files are all there
        assert sb.disk_mode == "loop" and sb.disk_mount is not None
        layer = sb.disk_mount
        assert f" {layer} " in await asyncio.to_thread(Path("/proc/self/mountinfo").read_text)
    # The layer's file system is gone with the container: no mount, no loop device on its image left.
    assert f" {layer} " not in await asyncio.to_thread(Path("/proc/self/mountinfo").read_text)
    backing = await asyncio.to_thread(
        lambda: [p.read_text() for p in Path("/sys/block").glob("loop*/loop/backing_file")])
    assert not any("ares-disk-" in b for b in backing), backing


async def test_kernel_keyring_is_refused_in_the_container() -> None:
    require_agent_base()
    probe = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "SYS_add_key, SYS_keyctl, SYS_request_key = 248, 250, 249\n"
        "r = libc.syscall(SYS_add_key, b'user', b'ares-probe', b'secret', 6, -2)\n"  # session keyring
        "print('add_key', r, ctypes.get_errno())\n"
        "r = libc.syscall(SYS_keyctl, 0, -3, 0)\n"  # KEYCTL_GET_KEYRING_ID of the user keyring
        "print('keyctl', r, ctypes.get_errno())\n"
        "r = libc.syscall(SYS_request_key, b'user', b'ares-probe', None, 0)\n"
        "print('request_key', r, ctypes.get_errno())\n"
    )
    async with DockerSandbox(SandboxSpec(image=BASE_IMAGE, network="none")) as sb:
        for user in ("agent", "root"):
            r = await sb.exec(["python3", "-I", "-c", probe], user=user)
            lines = dict(line.split(" ", 1) for line in r.stdout.strip().splitlines())
            assert set(lines) == {"add_key", "keyctl", "request_key"}, r.stdout + r.stderr
            for call, result in lines.items():
                assert result == "-1 1", (user, call, result)  # EPERM from seccomp


async def test_disk_limit_that_cannot_be_enforced_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the layer cannot be loop-mounted (here: as if not root) the engine's quota is asked
    for; this engine (overlay2 on extfs) refuses it, and the sandbox does not start unlimited."""
    require_agent_base()
    from sandbox.docker import client

    if "xfs" in str(client().info().get("DriverStatus")):
        pytest.skip("an xfs data root may grant the quota")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    sb = DockerSandbox(SandboxSpec(image=BASE_IMAGE, network="none", resources=Resources(disk="64m")))
    with pytest.raises(sandbox.SandboxStartError, match=r"cannot limit the disk .* to 64 MiB"):
        await sb.start()
    assert sb.state == "stopped"
    left = client().containers.list(all=True, filters={"label": f"{janitor.SANDBOX_LABEL}={sb.id}"})
    assert left == []
