"""The local backend enforces ``spec.resources`` (memory, pids, disk) and says so.

Real processes, real cgroups (v2, hybrid or v1, as the host has them), a real loop-mounted ext4:
hardened bubblewrap sandboxes, as root.  Each limit is hit for real by the unprivileged agent user,
and the host, a neighbour sandbox and the sandbox itself are fine afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import sandbox
from sandbox import Resources, SandboxSpec, local
from sandbox import _cgroup as cgroups
from sandbox import _disk as loopdisk
from sandbox.gc import collect_garbage
from sandbox.local import LocalSandbox, bwrap_available

REPO = Path(__file__).resolve().parents[2]
GIB = 1 << 30
MIB = 1 << 20


@pytest.fixture
def local_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    if not bwrap_available() or os.geteuid() != 0:
        pytest.skip("limits on local sandboxes need bubblewrap and root")
    root = tmp_path / "sandboxes"
    monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(root))
    return root


def _needs(*names: str) -> None:
    layout = cgroups.layout()
    have = {"memory": layout is not None and layout.memory is not None,
            "pids": layout is not None and layout.pids is not None,
            "disk": loopdisk.unavailable_reason() is None}
    missing = [n for n in names if not have[n]]
    if missing:
        pytest.skip(f"this host cannot enforce {missing} (no cgroup controller or loop devices)")


def _spec(**resources: object) -> SandboxSpec:
    return SandboxSpec(hardened=True, network="none", resources=Resources(**resources))  # type: ignore[arg-type]


def _pgrep(needle: str) -> list[int]:
    """Live host processes whose command line contains ``needle``."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if (entry.isdigit()
                and needle.encode() in Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")):
                found.append(int(entry))
        except OSError:
            continue
    return found


def _mounted(path: Path) -> bool:
    return any(line.split()[4] == str(path) for line in Path("/proc/self/mountinfo").read_text().splitlines())


async def _start(spec: SandboxSpec) -> LocalSandbox:
    sb = sandbox.create(spec, backend="local")
    assert isinstance(sb, LocalSandbox)
    await sb.start()
    return sb


TOUCH = "python3 -c \"b = bytearray(b'x') * ({n}); print('touched', len(b))\""


async def test_memory_limit_oom_kills_the_command_and_is_reported(local_root: Path) -> None:
    _needs("memory")
    limited = await _start(_spec(memory="256m"))
    neighbour = await _start(_spec())
    try:
        assert limited.limits_enforced == {"memory"}
        assert "memory 256 MiB" in limited.description
        # 1.5 GiB, every page written: killed by the kernel's OOM killer inside the sandbox's cgroup.
        big, small = await asyncio.gather(
            limited.exec(TOUCH.format(n=3 * GIB // 2), user="agent", timeout=120),
            neighbour.exec(TOUCH.format(n=512 * MIB), user="agent", timeout=120),
        )
        assert big.exit_code in (137, -9) and "touched" not in big.stdout, big
        assert await limited.limits_reached() == {"memory"}
        # The neighbour (no limit) and the host were not touched; the sandbox itself still works.
        assert small.ok and f"touched {512 * MIB}" in small.stdout, small
        assert await neighbour.limits_reached() == frozenset()
        assert (await limited.exec(TOUCH.format(n=64 * MIB), user="agent", timeout=60)).ok
    finally:
        await limited.stop()
        await neighbour.stop()


BOMB = textwrap.dedent("""\
    import os, time
    ok = refused = 0
    for _ in range(300):  # bounded: at most 300 children, each gone after 60 s
        try:
            pid = os.fork()
        except OSError:
            refused += 1
            continue
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        ok += 1
    with open("/tmp/bomb.out", "w") as fh:
        fh.write(f"{ok} {refused}")
    time.sleep(60)
""")


async def test_pids_limit_refuses_forks_and_kill_processes_cleans_up(local_root: Path) -> None:
    _needs("pids")
    sb = await _start(_spec(pids=64))
    try:
        assert sb.limits_enforced == {"pids"}
        (sb.root / "tmp" / "bomb.py").write_text(BOMB)
        launched = await sb.exec("setsid nohup python3 /tmp/bomb.py >/dev/null 2>&1 </dev/null &",
                                 user="agent", timeout=30)
        assert launched.ok, launched
        out = sb.root / "tmp" / "bomb.out"
        for _ in range(600):
            if out.exists() and out.read_text():
                break
            await asyncio.sleep(0.05)
        ok, refused = map(int, out.read_text().split())
        assert refused > 0 and ok < 64, (ok, refused)
        assert "pids" in await sb.limits_reached()
        assert sb._cgroup is not None and len(sb._cgroup.members("cmds")) > ok // 2
        killed = await sb.kill_processes(timeout=30)
        assert killed >= ok
        assert sb._cgroup.members("cmds") == set()
        assert (await sb.exec("echo after", user="agent", timeout=30)).stdout == "after\n"
    finally:
        await sb.stop()


async def test_disk_limit_gives_enospc_and_is_reported(local_root: Path) -> None:
    _needs("disk")
    sb = await _start(_spec(disk="100m"))
    try:
        assert sb.limits_enforced == {"disk"}
        assert await sb.limits_reached() == frozenset()
        wrote = await sb.exec("dd if=/dev/zero of=/workspace/big bs=1M count=5120 2>&1; sync; "
                              "stat -c %s /workspace/big", user="agent", timeout=120)
        assert "No space left on device" in wrote.stdout, wrote
        size = int(wrote.stdout.split()[-1])
        assert 50 * MIB < size < 100 * MIB
        # /tmp and /home share the quota; the host holds no more than the quota for the sandbox.
        more = await sb.exec("dd if=/dev/zero of=/tmp/more bs=1M count=10 2>&1", user="agent", timeout=30)
        assert "No space left on device" in more.stdout, more
        image = local_root / f".{sb.id}.disk.img"
        assert image.stat().st_blocks * 512 < 110 * MIB
        assert await sb.limits_reached() == {"disk"}
        # Sticky: freeing the space afterwards does not hide that the limit was reached.
        assert (await sb.exec("rm /workspace/big", user="agent", timeout=30)).ok
        assert await sb.limits_reached() == {"disk"}
    finally:
        await sb.stop()
    assert not image.exists() and not _mounted(sb.root)


async def test_stop_leaves_no_cgroup_mount_image_or_process(local_root: Path) -> None:
    _needs("memory", "pids", "disk")
    sb = await _start(_spec(memory="256m", pids=128, disk="64m"))
    assert sb.limits_enforced == {"memory", "pids", "disk"}
    assert sb._cgroup is not None
    dirs = list(sb._cgroup.dirs)
    assert len(dirs) >= 1 and all(d.is_dir() for d in dirs)
    assert _mounted(sb.root)
    await sb.exec("setsid unshare -Urpf sleep 654321.5 >/dev/null 2>&1 </dev/null &", timeout=30)
    await sb.exec("setsid sleep 654321.25 >/dev/null 2>&1 </dev/null &", user="agent", timeout=30)
    await sb.stop()
    assert [d for d in dirs if d.exists()] == []
    assert not _mounted(sb.root) and not sb.root.exists()
    assert [n for n in os.listdir(local_root) if n.endswith(".disk.img")] == []
    assert not _pgrep("sleep 654321")


async def test_unenforced_limits_are_named_in_the_description(local_root: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cgroups, "layout", lambda: None)
    monkeypatch.setattr(loopdisk, "unavailable_reason", lambda: "no loop devices (/dev/loop-control)")
    sb = await _start(_spec(memory="256m", pids=64, disk="100m"))
    try:
        assert sb.limits_enforced == frozenset()
        assert "limits NOT enforced: disk (no loop devices" in sb.description
        assert "memory (no usable memory cgroup controller)" in sb.description
        assert "PID namespace only" in sb.description
        assert await sb.limits_reached() == frozenset()
    finally:
        await sb.stop()


CHILD = textwrap.dedent("""\
    import asyncio, json, sys
    sys.path.insert(0, sys.argv[1])
    import sandbox
    async def main():
        spec = sandbox.SandboxSpec(hardened=True, network="none",
                                   resources=sandbox.Resources(memory="256m", pids=128, disk="64m"))
        sb = sandbox.create(spec, backend="local")
        await sb.start()
        await sb.exec("setsid unshare -Urpf sleep 765432.5 >/dev/null 2>&1 </dev/null &")
        print(json.dumps({"id": sb.id, "dirs": [str(d) for d in sb._cgroup.dirs]}), flush=True)
        await asyncio.sleep(600)
    asyncio.run(main())
""")


def test_gc_removes_a_dead_owners_cgroups_disk_and_processes(local_root: Path) -> None:
    _needs("memory", "pids", "disk")
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(REPO)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "ARES_SANDBOX_LOCAL_ROOT": str(local_root)})
    try:
        assert child.stdout is not None
        made = json.loads(child.stdout.readline())
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    root = local_root / made["id"]
    try:
        dirs = [Path(d) for d in made["dirs"]]
        # SIGKILL left the cgroups and the mount behind (the keeper's PID namespace, and with it the
        # nested one, died with its owner).
        assert all(d.is_dir() for d in dirs) and _mounted(root)
        report = collect_garbage(["local"])
        assert f"local:{made['id']}" in report.removed, report
        assert not report.errors, report
        assert [d for d in dirs if d.exists()] == []
        assert not _mounted(root) and not root.exists()
        assert not (local_root / f".{made['id']}.disk.img").exists()
        assert not _pgrep("sleep 765432")
    finally:  # whatever failed above, nothing of it stays on this host
        if root.exists() or any(Path(d).exists() for d in made["dirs"]):
            local.gc_remove(made["id"])


def test_cgroup_v2_files_on_a_plain_directory(tmp_path: Path) -> None:
    """The v2 path this hybrid CI host cannot take (its memory and pids controllers are v1): which files
    a v2 sandbox group gets and how its event counters are read, on a plain directory laid out like one."""
    base = tmp_path / "ares-sandboxes"
    base.mkdir()
    v2 = cgroups.Hierarchy(mount=tmp_path, version=2, controllers=frozenset({"memory", "pids"}), base=base)
    group = cgroups.SandboxCgroup.create("abc", cgroups.Layout(track=v2, memory=v2, pids=v2),
                                         memory=256 * MIB, pids=64)
    d = base / "abc"
    assert group.dirs == [d]
    assert (d / "memory.max").read_text() == str(256 * MIB) and (d / "pids.max").read_text() == "64"
    assert (d / "keeper").is_dir() and (d / "cmds").is_dir()
    assert group.join_prefix("cmds")[-2:] == [str(d / "cmds" / "cgroup.procs"), "--"]
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 1\noom_kill 0\noom_group_kill 0\n")
    (d / "pids.events").write_text("max 0\n")
    assert group.limits_reached() == set()  # memory.max reached and reclaimed: not an OOM kill
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 40\noom 2\noom_kill 1\noom_group_kill 0\n")
    (d / "cmds" / "pids.events").write_text("max 3\n")
    assert group.limits_reached() == {"memory", "pids"}
    assert json.loads(group.record()) == {"id": "abc", "dirs": [str(d)]}
    for leaf in (d, d / "keeper", d / "cmds"):  # what the kernel would not let exist as files
        for f in list(leaf.glob("*.*")):
            f.unlink()
    assert group.remove(timeout=1) == [] and not d.exists()


def test_mountinfo_layouts_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pure_v2 = ("30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 "
               "rw,nsdelegate\n")
    hybrid = ("41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
              "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
              "39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids\n"
              "22 1 8:1 / / rw - ext4 /dev/vda rw\n")
    real_read = Path.read_text

    def fake(text: str) -> None:
        monkeypatch.setattr(Path, "read_text",
                            lambda self, *a,
                            **k: text if str(self) == "/proc/self/mountinfo" else real_read(self))

    fake(pure_v2)
    assert [(m[1], m[2]) for m in cgroups._mounts()] == [(Path("/sys/fs/cgroup"), "cgroup2")]
    fake(hybrid)
    assert [(str(m[1]), m[2], "memory" in m[3], "pids" in m[3]) for m in cgroups._mounts()] == [
        ("/sys/fs/cgroup/unified", "cgroup2", False, False),
        ("/sys/fs/cgroup/memory", "cgroup", True, False),
        ("/sys/fs/cgroup/pids", "cgroup", False, True),
    ]


async def test_a_start_cancelled_while_its_limits_are_set_up_leaves_nothing(local_root: Path) -> None:
    """A run stopped (Ctrl-C) while a sandbox starts: start()'s cleanup must not run before the thread
    setting its disk up is done, or the disk that thread then mounts (and its image) outlive the sandbox."""
    _needs("memory", "pids", "disk")
    for delay in (0.0, 0.002, 0.005, 0.01, 0.02, 0.04, 0.08):
        sb = sandbox.create(_spec(memory="256m", pids=64, disk="64m"), backend="local")
        starting = asyncio.create_task(sb.start())
        await asyncio.sleep(delay)
        starting.cancel()
        try:
            await starting
        except asyncio.CancelledError:
            pass
        await sb.stop()
        assert not _mounted(sb.root), delay
    assert os.listdir(local_root) == []
