"""One contract, every backend: local, Docker (real engine) and Daytona (real SDK against the fake)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import os
import threading
from pathlib import Path

import pytest

import sandbox
from bench.support.daytona_fake import DaytonaFake
from sandbox import ExecError, FileTransferError, SandboxStateError

from .conftest import SandboxFactory, backend_holds, user_for


async def test_exit_code_stdout_stderr(make_sandbox: SandboxFactory) -> None:
    sb = await make_sandbox()
    result = await sb.exec("echo out; echo err >&2; exit 7")
    assert result.stdout == "out\n"
    assert result.stderr == "err\n"
    assert result.exit_code == 7
    assert not result.timed_out and not result.ok
    assert result.duration > 0
    ok = await sb.exec("true")
    assert ok.ok and ok.exit_code == 0 and ok.stdout == "" and ok.stderr == ""


async def test_list_command_is_quoted(make_sandbox: SandboxFactory) -> None:
    sb = await make_sandbox()
    result = await sb.exec(["printf", "%s|", "a b", "$HOME", "it's"])
    assert result.stdout == "a b|$HOME|it's|"


async def test_env_from_spec_and_call(make_sandbox: SandboxFactory) -> None:
    sb = await make_sandbox(env={"SPEC_VAR": "from-spec", "BOTH": "spec"})
    result = await sb.exec('echo "$SPEC_VAR $CALL_VAR $BOTH"', env={"CALL_VAR": "from call", "BOTH": "call"})
    assert result.stdout == "from-spec from call call\n"
    assert (await sb.exec('echo "${CALL_VAR:-unset}"')).stdout == "unset\n"


async def test_cwd(make_sandbox: SandboxFactory) -> None:
    sb = await make_sandbox()
    assert (await sb.exec("pwd")).stdout.strip() == sb.workdir
    assert (await sb.exec("mkdir -p sub/dir")).ok
    assert (await sb.exec("pwd", cwd="sub/dir")).stdout.strip() == f"{sb.workdir}/sub/dir"
    assert (await sb.exec("pwd", cwd=f"{sb.workdir}/sub")).stdout.strip() == f"{sb.workdir}/sub"
    with pytest.raises(ExecError, match=r"does not exist|no such file"):
        await sb.exec("pwd", cwd="/definitely/not/here")


async def test_user(make_sandbox: SandboxFactory, backend: str) -> None:
    sb = await make_sandbox()
    user = user_for(backend)
    result = await sb.exec("id -un; id -u", user=user)
    name, uid = result.stdout.split()
    assert name == user and uid != "0"
    assert (await sb.exec("id -u")).stdout.strip() == "0"


async def test_timeout_kills_the_process_group(make_sandbox: SandboxFactory) -> None:
    sb = await make_sandbox()
    result = await sb.exec("(sleep 2; echo late > late.txt) & echo $! > bg.pid; sleep 300", timeout=1)
    assert result.timed_out and not result.ok
    assert result.exit_code != 0
    assert 0.9 < result.duration < 20
    await asyncio.sleep(2.5)
    # The background child would have written late.txt by now had it survived.
    check = await sb.exec('test -e late.txt && echo survived || echo killed; kill -0 "$(cat bg.pid)" '
                          '2>/dev/null && echo alive || echo gone')
    assert check.stdout.split() == ["killed", "gone"]
    # The sandbox is still usable after a timeout, and a quick command is not marked timed out.
    quick = await sb.exec("echo fine", timeout=30)
    assert quick.ok and quick.stdout == "fine\n" and not quick.timed_out


async def test_large_binary_file_round_trip(make_sandbox: SandboxFactory, tmp_path: Path) -> None:
    sb = await make_sandbox()
    data = os.urandom(6 * 1024 * 1024 + 17) + bytes(range(256)) + b"\0\r\n\xff"
    src = tmp_path / "blob.bin"
    src.write_bytes(data)
    await sb.upload_file(src, "data/nested/blob.bin")
    inside = await sb.exec("wc -c < data/nested/blob.bin; sha256sum data/nested/blob.bin")
    size, digest = inside.stdout.split()[:2]
    assert int(size) == len(data)
    assert digest == hashlib.sha256(data).hexdigest()
    back = tmp_path / "back" / "blob.bin"
    await sb.download_file(f"{sb.workdir}/data/nested/blob.bin", back)
    assert back.read_bytes() == data


async def test_directory_round_trip(make_sandbox: SandboxFactory, tmp_path: Path) -> None:
    sb = await make_sandbox()
    src = tmp_path / "proj"
    (src / "pkg" / "deep").mkdir(parents=True)
    (src / "README.md").write_text("hello\n")
    (src / "pkg" / "mod.py").write_text("print('hi')\n")
    (src / "pkg" / "deep" / "blob.bin").write_bytes(os.urandom(300_000))
    (src / "empty.txt").write_bytes(b"")
    (src / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (src / "run.sh").chmod(0o755)
    await sb.upload_dir(src, "proj")
    assert (await sb.exec("./run.sh", cwd="proj")).stdout == "ran\n"
    assert (await sb.exec("cat proj/pkg/mod.py")).stdout == "print('hi')\n"
    assert (await sb.exec("echo made-inside > proj/pkg/new.txt")).ok
    out = tmp_path / "out"
    await sb.download_dir("proj", out)
    for path in src.rglob("*"):
        if path.is_file():
            assert (out / path.relative_to(src)).read_bytes() == path.read_bytes(), path
    assert (out / "pkg" / "new.txt").read_text() == "made-inside\n"
    assert os.access(out / "run.sh", os.X_OK)


async def test_missing_remote_file_is_a_clear_error(make_sandbox: SandboxFactory, tmp_path: Path) -> None:
    sb = await make_sandbox()
    with pytest.raises(FileTransferError):
        await sb.download_file("no/such/file.txt", tmp_path / "x")
    with pytest.raises(FileTransferError):
        await sb.upload_file(tmp_path / "does-not-exist", "x")


async def test_stop_double_stop_and_use_after_stop(
    make_sandbox: SandboxFactory, tmp_path: Path, backend_fake: DaytonaFake | None
) -> None:
    sb = await make_sandbox()
    assert isinstance(sb, sandbox.Sandbox)
    assert sb.state == "running" and sb.description
    assert backend_holds(sb, backend_fake)
    await sb.stop()
    assert not backend_holds(sb, backend_fake)
    await sb.stop()
    sb.stop_and_remove()
    assert sb.state == "stopped"
    with pytest.raises(SandboxStateError, match="stopped"):
        await sb.exec("true")
    with pytest.raises(SandboxStateError, match="stopped"):
        await sb.upload_file(tmp_path, "x")
    with pytest.raises(SandboxStateError, match="cannot be started again"):
        await sb.start()


async def test_a_stop_cancelled_before_its_removal_ran_leaves_it_to_stop_and_remove(
    make_sandbox: SandboxFactory, backend_fake: DaytonaFake | None
) -> None:
    sb = await make_sandbox()
    loop = asyncio.get_running_loop()
    # One worker thread, held busy: the stop's removal waits in the executor's queue, and cancelling the
    # stop takes it off the queue before it ran (as on a loaded machine with every worker busy).
    busy, gate = concurrent.futures.ThreadPoolExecutor(max_workers=1), threading.Event()
    loop.set_default_executor(busy)
    try:
        held = loop.run_in_executor(None, gate.wait)
        stopping = asyncio.ensure_future(sb.stop())
        for _ in range(5):
            await asyncio.sleep(0)
        stopping.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stopping
        assert sb.state == "running" and backend_holds(sb, backend_fake)  # not removed, and it says so
        sb.stop_and_remove()  # what the episode's fallback and the janitor at exit call
        assert sb.state == "stopped" and not backend_holds(sb, backend_fake)
    finally:
        gate.set()
        await held
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor())
        busy.shutdown(wait=False)


async def _held_start(sb: sandbox.Sandbox) -> tuple[asyncio.Event, asyncio.Future[None]]:
    """``sb.start()`` under way, held before the backend creates anything until the returned event is
    set; and the start's task."""
    gate, start = asyncio.Event(), sb._start  # type: ignore[attr-defined]

    async def held() -> None:
        await gate.wait()
        await start()

    sb._start = held  # type: ignore[attr-defined]
    starting = asyncio.ensure_future(sb.start())
    await asyncio.sleep(0.05)
    return gate, starting


async def test_stop_during_start_lets_the_start_settle_then_removes_it(
    make_sandbox: SandboxFactory, backend_fake: DaytonaFake | None
) -> None:
    sb = await make_sandbox(start=False)
    gate, starting = await _held_start(sb)
    stopping = asyncio.ensure_future(sb.stop())
    await asyncio.sleep(0.05)
    assert not stopping.done() and sb.state == "created"  # it waits for the start, not past it
    gate.set()
    await asyncio.wait_for(stopping, 60)
    await starting  # the start itself went through; the stop then removed what it made
    assert sb.state == "stopped" and not backend_holds(sb, backend_fake)


async def test_stop_and_remove_during_start_removes_what_the_start_then_made(
    make_sandbox: SandboxFactory, backend_fake: DaytonaFake | None
) -> None:
    sb = await make_sandbox(start=False)
    gate, starting = await _held_start(sb)
    sb.stop_and_remove()  # the janitor at exit, or an episode's synchronous fallback
    gate.set()
    with pytest.raises(SandboxStateError, match="stopped while it started"):
        await asyncio.wait_for(starting, 60)
    assert sb.state == "stopped" and not backend_holds(sb, backend_fake)


async def test_a_start_that_outlasts_the_stops_wait_removes_itself_when_done(
    make_sandbox: SandboxFactory, backend_fake: DaytonaFake | None
) -> None:
    sb = await make_sandbox(start=False)
    sb.stop_waits_for_start = 0.2  # type: ignore[attr-defined]
    gate, starting = await _held_start(sb)
    await asyncio.wait_for(sb.stop(), 30)  # returns after its wait, the start still held
    assert sb.state == "stopped" and not starting.done()
    gate.set()
    with pytest.raises(SandboxStateError, match="stopped while it started"):
        await asyncio.wait_for(starting, 60)
    assert sb.state == "stopped" and not backend_holds(sb, backend_fake)


async def test_use_before_start(make_sandbox: SandboxFactory) -> None:
    sb = await make_sandbox(start=False)
    with pytest.raises(SandboxStateError, match="not started"):
        await sb.exec("true")


async def test_async_with_removes_on_exception(make_sandbox: SandboxFactory) -> None:
    sb = await make_sandbox(start=False)
    with pytest.raises(RuntimeError, match="boom"):
        async with sb:
            assert (await sb.exec("echo in")).stdout == "in\n"
            raise RuntimeError("boom")
    assert sb.state == "stopped"
    assert sb not in sandbox.janitor.live_sandboxes()


async def test_background_process_outlives_its_exec_until_stop(make_sandbox: SandboxFactory) -> None:
    """Harnesses launch agents detached: a background process must survive the command that started it."""
    sb = await make_sandbox()
    started = await sb.exec(
        "nohup sh -c 'while :; do date +%s%N >> beat.txt; sleep 0.2; done' >/dev/null 2>&1 &")
    assert started.ok, started
    async def beats() -> int:
        out = (await sb.exec("cat beat.txt 2>/dev/null | wc -l")).stdout.strip()
        return int(out or 0)

    first = await beats()
    for _ in range(50):  # generous under load: the loop only has to keep beating after the exec returned
        await asyncio.sleep(0.2)
        if await beats() > first + 1:
            return
    raise AssertionError("the detached loop stopped when its exec returned")


@pytest.mark.asyncio(loop_factories=["uvloop", "asyncio"])
async def test_detached_launch_returns_promptly_on_every_loop(make_sandbox: SandboxFactory) -> None:
    """How harnesses launch agents: a detached session with its stdio on /dev/null. The exec returns at once.

    uvloop's own subprocess spawn leaks the exec's pipe fds into the child; a backend that used it
    held the exec open until the detached process ended (every episode over ~30 s failed).
    """
    loop = type(asyncio.get_running_loop()).__module__
    sb = await make_sandbox()
    r = await sb.exec("setsid sh -c 'sleep 60' >/dev/null 2>&1 </dev/null & echo $!", timeout=30)
    assert r.ok, r
    assert r.duration < 10, (f"{loop}: the launch exec took {r.duration:.1f} s (held open by the "
                             "detached process)")
    pid = r.stdout.strip()
    assert pid.isdigit(), r
    alive = await sb.exec(f"kill -0 {pid} && echo alive", timeout=30)
    assert alive.stdout.strip() == "alive", "the detached process died with its exec"


@pytest.mark.asyncio(loop_factories=["uvloop", "asyncio"])
async def test_exec_sees_no_fd_of_the_gateway_process(make_sandbox: SandboxFactory, backend: str) -> None:
    """Nothing the host process holds open (sockets, pipes) is inherited by a command in the sandbox."""
    if backend != "local":
        pytest.skip("containers and remote sandboxes never share the host process's fds")
    sb = await make_sandbox()
    r = await sb.exec("ls /proc/self/fd", timeout=30)
    assert r.ok, r
    fds = sorted(int(x) for x in r.stdout.split())
    # 0-2 are stdio; ls itself opens one fd to read /proc/self/fd.
    assert len(fds) <= 4 and max(fds) <= 3, f"inherited fds: {fds}"


@pytest.mark.asyncio(loop_factories=["uvloop", "asyncio"])
async def test_concurrent_execs_each_get_their_own_output_while_threads_open_fds(
        make_sandbox: SandboxFactory, backend: str) -> None:
    """Commands run 8 at a time while other threads spawn processes (as file transfers, the turn
    store's writer and the default executor do): every command gets exactly its own output, and so
    does every thread. uvloop closes a pipe transport's fd twice; with the local backend's pipes
    read through such transports, 1 in ~80 commands here got another command's output, none at
    all (a 10 s timeout), or failed to start with EBADF."""
    if backend != "local":
        pytest.skip("the host-side pipes of a command are the local backend's")
    import subprocess
    import threading

    sb = await make_sandbox()
    wrong: list[object] = []
    stop = threading.Event()

    def spawner() -> None:
        while not stop.is_set():
            try:
                r = subprocess.run(["echo", "thread"], capture_output=True, close_fds=True, timeout=30)
                if r.stdout != b"thread\n":
                    wrong.append(("thread", r.stdout))
            except Exception as exc:  # every failure is the finding
                wrong.append(("thread", repr(exc)))

    threads = [threading.Thread(target=spawner, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()

    async def one(i: int) -> None:
        try:
            r = await sb.exec(f"echo out {i}; echo err {i} >&2", timeout=10)
        except Exception as exc:  # every failure is the finding
            wrong.append((i, repr(exc)))
            return
        if (r.stdout, r.stderr, r.exit_code) != (f"out {i}\n", f"err {i}\n", 0):
            wrong.append((i, r))

    try:
        for start in range(0, 480, 8):
            await asyncio.gather(*(one(i) for i in range(start, start + 8)))
            if len(wrong) > 3:
                break
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not wrong, wrong[:5]
