"""Grading the agent cannot reach: by default a task's tests run in a fresh sandbox holding only a
copy of the agent's final workdir, and a reward outside the task's range is a verifier error.

* the copy (:func:`copy_workspace`) over real sandboxes (hardened local; Docker when an engine
  answers): symbolic links stay links (to the host, to ``/tests``), FIFOs, sockets and device nodes
  are left out, set-id bits cleared, odd names and deep trees kept, the files the agent's uid's; a
  forged archive (the agent as root replaced ``tar``) writes nothing outside the workdir; an archive
  over the bound is a clear error;
* real episodes (mini-swe-agent with the scripted policy, so the agent itself runs the commands):
  files the agent left outside the workdir and a process it left running are not there at grading,
  a checker that imports from a fixed ``/tmp`` directory is not hijacked, a huge (sparse) workdir
  is a verifier error, ``[verifier] sandbox = "agent"`` keeps the agent's services running for its
  tests, and the grading sandbox is removed after success, failure and cancellation;
* rewards: ``{"tests": 1e308}``, -1 and 2 are verifier errors under the default ``[0, 1]``; a
  declared range admits its own values; ``[verifier] user`` naming the agent's user is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import secrets
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path
from shlex import quote as shlex_quote
from typing import Any

import pytest

import sandbox as sandbox_mod
from ares_gateway import EpisodeConfig, Gateway, GatewayEnv, RunConfig
from ares_gateway.episodes.episode import harness_side_call_detector
from ares_gateway.episodes.rollouts import run_rollouts
from ares_gateway.episodes.tasks import Task, TaskConfigError, parse_task_config
from ares_gateway.episodes.verifier import WorkspaceCopyError, copy_workspace, run_tests
from ares_gateway.policies import call_policy, make_policy
from harnesses.tiny_agent import TinyAgentHarness
from tests.helpers import CrashingHarness, left_behind
from tests.rollouts.e2e import AGENTS_IMAGE, require_backend, require_mini
from tests.security.test_exploits import task_dir

HERE = Path(__file__).resolve().parent
BACKENDS = ["local", pytest.param("docker", marks=pytest.mark.docker)]


def _spec() -> sandbox_mod.SandboxSpec:
    return sandbox_mod.SandboxSpec(image=AGENTS_IMAGE, workdir="/workspace", network="none", hardened=True,
                                   labels={"ares-gateway.test": "grading"})


@contextlib.asynccontextmanager
async def _pair(backend: str) -> AsyncIterator[tuple[Any, Any]]:
    """Two started sandboxes of one spec: the agent's and the grading one."""
    src = sandbox_mod.create(_spec(), backend=backend)
    dst = sandbox_mod.create(_spec(), backend=backend)
    try:
        await asyncio.gather(src.start(), dst.start())
        yield src, dst
    finally:
        await asyncio.gather(src.stop(), dst.stop())


async def _root(sb: Any, cmd: str) -> str:
    r = await sb.exec(cmd, cwd="/", user=None if sb.backend == "local" else "root", timeout=120)
    assert r.ok, (cmd, r.stdout, r.stderr)
    return str(r.stdout)


# A tree with everything a copy must not follow, keep, or hang on.
HOSTILE_TREE = r"""
set -e
cd /workspace
echo hi > plain && printf '#!/bin/sh\necho ran\n' > run.sh && chmod 755 run.sh
mkdir -p sub && echo x > sub/f && ln -s ../plain sub/rel-link
ln -s /etc/hostname abs-link && ln -s {host_file} host-link && ln -s /tests/test.sh tests-link && ln -s /tmp tmp-link
ln plain hard
mkfifo fifo
python3 -c "import socket; socket.socket(socket.AF_UNIX).bind('sock')"
printf odd > "$(printf 'a\nb\377c')"
d=deep; i=0; while [ $i -lt 150 ]; do d=$d/d; i=$((i+1)); done; mkdir -p $d && echo bottom > $d/f
{mknod}
chown -R 1000:1000 /workspace
cp /bin/true suid && chmod 4755 suid && cp /bin/true sgid && chmod 2755 sgid
echo outside > /tmp/agent-left-this
"""  # noqa: E501 (an embedded script, kept as it runs)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_copy_keeps_the_tree_and_drops_what_could_leak_or_hang(
        backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_backend(backend)
    monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(tmp_path / "sandboxes"))
    secret = "host-secret-" + secrets.token_hex(8)
    host_file = tmp_path / "secret.txt"
    host_file.write_text(secret)
    async with _pair(backend) as (src, dst):
        # Root in a hardened local sandbox has no CAP_MKNOD; in a container it has.
        await _root(src, HOSTILE_TREE.format(host_file=host_file,
                                             mknod="mknod null-dev c 1 3" if backend == "docker" else ""))
        await _root(dst, "echo image-file > /workspace/from-the-image")  # the agent deleted it
        size = await asyncio.wait_for(
            copy_workspace(src, dst, src_workdir="/workspace", dst_workdir="/workspace",
                           user="1000"), 120)
        assert size > 0
        listing = await _root(dst, "cd /workspace && find . -printf '%y %U %m %p -> %l\\0'")
        lines = [line for line in listing.split("\0") if line]
        entries = {line.split(" ", 3)[3].split(" -> ")[0]: line for line in lines}
        types = {name: line.split()[0] for name, line in entries.items()}
        assert types["./plain"] == "f" and types["./hard"] == "f" and types["./run.sh"] == "f"
        assert entries["./abs-link"].endswith("-> /etc/hostname") and types["./abs-link"] == "l"
        assert entries["./host-link"].endswith(f"-> {host_file}") and types["./host-link"] == "l"
        assert entries["./tests-link"].endswith("-> /tests/test.sh") and entries["./tmp-link"].endswith(
            "-> /tmp")
        assert entries["./sub/rel-link"].endswith("-> ../plain")
        assert not {"./fifo", "./sock", "./null-dev", "./from-the-image"} & set(entries), listing
        assert all(line.split()[1] == "1000" for line in lines), listing  # the agent's uid
        assert entries["./suid"].split()[2] == "755" and entries["./sgid"].split()[2] == "755"
        assert entries["./run.sh"].split()[2] == "755"
        assert any(name.startswith("./a") and types[name] == "f" for name in entries if name != "./abs-link")
        assert any(name.endswith("/d/f") for name in entries)
        assert (await _root(dst, "cat /workspace/sub/rel-link /workspace/hard")).split() == ["hi", "hi"]
        assert secret not in await _root(dst, "grep -r . /workspace 2>/dev/null || true")
        assert "run.sh" not in await _root(dst, "ls -A /tmp")  # nothing else of the agent's
        assert (
            await _root(dst, "ls -A /tmp")).split() == [], "the archive or a file outside the workdir is left"


@pytest.mark.docker
async def test_a_forged_archive_writes_nothing_outside_the_workdir(tmp_path: Path) -> None:
    """The agent as root in its own container replaced ``tar``: what it emits is unpacked as the
    agent's uid in the grading sandbox, which keeps nothing outside the workdir."""
    require_backend("docker")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        def add(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", data: bytes = b"x",
                mode: int = 0o644, **kw: Any) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.linkname, info.mode, info.size = (kind, link, mode, len(data)
                                                              if kind == tarfile.REGTYPE else 0)
            for k, v in kw.items():
                setattr(info, k, v)
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

        add("ok")
        add("../escape")
        add("/abs-planted")
        add("lnk", tarfile.SYMTYPE, "/tmp")
        add("lnk/planted")
        add("hl", tarfile.LNKTYPE, "/etc/shadow")
        add("dev", tarfile.CHRTYPE, devmajor=1, devminor=3)
        add("suid", mode=0o4755, uid=0, gid=0)
    forged = tmp_path / "forged.tar"
    forged.write_bytes(buf.getvalue())
    async with _pair("docker") as (src, dst):
        await src.upload_file(forged, "/forged.tar")
        await _root(src, "printf '#!/bin/sh\\ncat >/dev/null; cat /forged.tar\\n' > /usr/local/bin/tar && "
                         "chmod 755 /usr/local/bin/tar")
        with contextlib.suppress(WorkspaceCopyError):  # tar says what it refused
            await copy_workspace(src, dst, src_workdir="/workspace", dst_workdir="/workspace", user="1000")
        outside = await _root(
            dst, "for f in /escape /abs-planted /tmp/planted /workspace/lnk/planted /forged.tar; do "
                 "[ -e \"$f\" ] && echo \"PRESENT $f\"; done; ls -A /tmp; true")
        # "/abs-planted" lands in the workdir as "abs-planted", if at all
        assert outside.split() == [], outside
        listing = await _root(dst, "find /workspace -printf '%y %U %m %p\\n'")
        assert " /workspace/dev" not in listing and "c " not in listing.split("\n")[0]
        assert not any(line.split()[1] == "0" for line in listing.splitlines()), listing  # nothing of root's
        assert not any(line.split()[2].startswith(("4", "2", "6")) and len(line.split()[2]) == 4
                       for line in listing.splitlines()), listing


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_workdir_over_the_bound_is_a_clear_error(
        backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_backend(backend)
    monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(tmp_path / "sandboxes"))
    async with _pair(backend) as (src, dst):
        await _root(src, "truncate -s 50G /workspace/sparse && chown 1000 /workspace/sparse")
        with pytest.raises(WorkspaceCopyError,
                           match=r"the workdir /workspace is too large to grade: its archive "
                                                     r"passes 1048576 bytes"):
            await asyncio.wait_for(
                copy_workspace(src, dst, src_workdir="/workspace", dst_workdir="/workspace",
                               user="1000", limit=1024 * 1024), 60)
        assert (await _root(dst, "ls -A /workspace")).split() == []


# ---------------------------------------------------------------------------------------------- episodes

# A checker copied to a fixed directory under /tmp and run from there, so that Python imports from
# that directory first: an agent that made the directory first (and left a json.py in it) is
# imported by root, unless the tests run where nothing of the agent's but its workdir is.
CHECKER = ("import json, pathlib, sys\n"
           "ok = pathlib.Path('/workspace/answer.txt').is_file() and "
           "pathlib.Path('/workspace/answer.txt').read_text().strip() == '42'\n"
           "pathlib.Path(sys.argv[1]).write_text(json.dumps({'tests': 1.0 if ok else 0.0}))\n")
HIJACK = ("import os, sys\n"
          "open(sys.argv[1], 'w').write('{\"tests\": 1.0}')\n"
          "print('HIJACKED AS', os.getuid(), flush=True)\n"
          "os._exit(0)\n")
LEFTOVERS_TEST_SH = (
    "#!/bin/sh\n"
    "echo '--- grading view'\n"
    "for f in /tmp/agent-left-this /home/agent/agent-left-this /tmp/heartbeat; do [ -e $f ] && echo "
    "\"LEFTOVER $f\"; done\nfor p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null | grep -q "
    "heartbeat-loop && echo \"PROCESS $p\"; done\necho '--- end'\n"
    "mkdir -p /tmp/check && cp /tests/check.py /tmp/check/ && python3 /tmp/check/check.py "
    "\"$ARES_VERIFIER_DIR/reward.json\"\n"
)
PLANT = (
    "mkdir -p /tmp/check && printf '%s' " + shlex_quote(HIJACK)
    + " > /tmp/check/json.py && chmod -R a+rwx /tmp/check; "
    "echo outside > /tmp/agent-left-this; echo outside > $HOME/agent-left-this; ls -la /tmp/check"
)
# setsid: out of the agent's process group and session; it beats while it lives, and writes a reward
# wherever it can.
HEARTBEAT = (
    "setsid nohup sh -c ': heartbeat-loop; while :; do date > /tmp/heartbeat; for d in /logs/verifier "
    "/tmp/ares-task-*/logs/verifier; do echo 1 > $d/reward.txt 2>/dev/null; done; sleep 0.05; done' "
    ">/dev/null 2>&1 < /dev/null & echo started"
)


def _task(root: Path, name: str, test_sh: str, *, toml_extra: str = "",
          files: dict[str, str] | None = None) -> Task:
    d = task_dir(root, name, test_sh=test_sh, workspace=True, toml_extra=toml_extra)
    for rel, text in (files or {}).items():
        (d / rel).write_text(text)
    return Task.load(d)


async def _mini(task: Task, commands: list[str], backend: str, out: Path) -> Any:
    async with Gateway(port=0, request_timeout=300,
                       side_call_detector=harness_side_call_detector("mini-swe-agent")) as gw:
        summary = await run_rollouts(
            [task], gateway=gw, policy=make_policy("scripted", commands=commands),
            episode=EpisodeConfig("mini-swe-agent", sandbox=backend, time_limit=150),
            run=RunConfig(out=out, stats="null"),
        )
    [episode] = summary.episodes
    return episode


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
async def test_what_the_agent_left_outside_its_workdir_is_not_there_at_grading(
        backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real episode: the agent (mini-swe-agent, scripted) leaves files in /tmp and its home, a
    detached process, and a json.py in the /tmp directory the checker is run from; it solves nothing.
    The tests see none of it and give 0.0 (in the agent's own sandbox, root imported the agent's
    json.py and wrote 1.0)."""
    require_mini(backend)
    monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(tmp_path / "sandboxes"))
    task = _task(tmp_path / "tasks", "leftovers", LEFTOVERS_TEST_SH, files={"tests/check.py": CHECKER})
    e = await _mini(task, [PLANT, HEARTBEAT, "sleep 0.5; cat /tmp/heartbeat"], backend, tmp_path / "out")
    log = (tmp_path / "out" / "logs" / "leftovers.0" / "verifier.log").read_text()
    assert e.exit_reason == "completed" and e.error is None, (e.exit_reason, e.error, log[-2000:])
    turns = (tmp_path / "out" / "turns" / "leftovers.0.jsonl").read_text()
    # it all ran
    assert "json.py" in turns and "started" in turns and "/tmp/heartbeat: No such file" not in turns
    view = log.split("--- grading view", 1)[1].split("--- end", 1)[0]
    assert view.split() == [], log[-2000:]  # no file outside the workdir, no process of the agent's
    assert "HIJACKED" not in log
    assert e.reward == 0.0, log[-2000:]
    assert left_behind(tmp_path / "sandboxes") == []


async def _play(env: GatewayEnv, commands: list[str], task: Task) -> Any:
    policy = make_policy("scripted", commands=commands)
    ts = await env.reset()
    if not ts.last():
        assert env.session is not None
        policy.bind(env.session.session_id, agent="mini-swe-agent", task=task)
    while not ts.last():
        ts = await env.step(await call_policy(policy, ts.observation))
    return ts


ANSWER_TEST_SH = ("#!/bin/sh\nif [ \"$(cat answer.txt 2>/dev/null)\" = 42 ]; then echo 1; else echo 0; fi > "
                  "$ARES_VERIFIER_DIR/reward.txt\n")
# A service the agent starts and leaves running; the tests ask it for the answer.
SERVE = ("echo 42 > answer.txt && setsid nohup python3 -m http.server 8642 --bind 127.0.0.1 >/dev/null 2>&1 "
         "< /dev/null & sleep 1; echo served")
SERVICE_TEST_SH = (
    "#!/bin/sh\n"
    "got=$(python3 -c \"import urllib.request as u; "
    "print(u.urlopen('http://127.0.0.1:8642/answer.txt', timeout=5).read().decode().strip())\" 2>&1)\n"
    "echo \"service said: $got\"\n"
    "if [ \"$got\" = 42 ]; then echo 1; else echo 0; fi > $ARES_VERIFIER_DIR/reward.txt\n"
)


async def test_fresh_grading_in_the_outcome_and_a_service_only_with_the_opt_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``[verifier] sandbox = "agent"`` keeps the agent's service running for its tests (1.0); by
    default the tests run in the fresh sandbox, where no service is (0.0), and the outcome says which."""
    require_backend("local")
    root = tmp_path / "sandboxes"
    monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(root))
    fresh = _task(tmp_path / "tasks", "fresh-service", SERVICE_TEST_SH)
    kept = _task(tmp_path / "tasks", "agent-service", SERVICE_TEST_SH, toml_extra='sandbox = "agent"\n')
    assert kept.config.grading == "agent" and fresh.config.grading == "fresh"
    envs = [GatewayEnv(task=t, harness=TinyAgentHarness(), sandbox="local") for t in (fresh, kept)]
    try:
        ts_fresh, ts_kept = await asyncio.gather(
            *(_play(env, [SERVE], t) for env, t in zip(envs, (fresh, kept),
                                                        strict=True)))
        assert ts_kept.info["grading"] == "agent" and ts_kept.reward == 1.0, ts_kept.info
        assert ts_fresh.info["grading"] == "fresh" and ts_fresh.reward == 0.0, ts_fresh.info
        assert ts_fresh.info["workspace_bytes"] > 0 and ts_fresh.info["grading_setup_seconds"] > 0
        assert ts_kept.info["workspace_bytes"] is None
        assert left_behind(root) == []
    finally:
        for env in envs:
            await env.close()


async def test_a_huge_sparse_workdir_is_a_verifier_error(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    require_backend("local")
    monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(tmp_path / "sandboxes"))
    task = _task(tmp_path / "tasks", "huge", "#!/bin/sh\necho 1 > $ARES_VERIFIER_DIR/reward.txt\n",
                 toml_extra="[environment]\nstorage_mb = 64\n")
    env = GatewayEnv(task=task, harness=TinyAgentHarness(), sandbox="local")
    try:
        ts = await _play(env, ["truncate -s 40G big.bin && ls -la"], task)
    finally:
        await env.close()
    assert ts.reward == 0.0 and ts.info["exit_reason"] == "completed", ts.info
    assert "the workdir /workspace is too large to grade: its archive passes 67108864 bytes" in \
        ts.info["verifier_error"], ts.info
    assert left_behind(tmp_path / "sandboxes") == []


async def test_the_grading_sandbox_goes_after_success_failure_and_cancellation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_backend("local")
    root = tmp_path / "sandboxes"
    monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(root))
    task = _task(tmp_path / "tasks", "answer", ANSWER_TEST_SH)
    ok = GatewayEnv(task=task, harness=TinyAgentHarness(), sandbox="local")
    crash = GatewayEnv(task=task, harness=CrashingHarness(), sandbox="local")
    stuck = GatewayEnv(task=task, harness=TinyAgentHarness(), sandbox="local")
    seen: list[Any] = []
    try:
        solved, crashed = await asyncio.gather(_play(ok, ["echo 42 > answer.txt"], task),
                                               _play(crash, [], task))
        assert solved.reward == 1.0 and solved.info["grading"] == "fresh", solved.info
        assert crashed.info["exit_reason"] == "agent_error" and crashed.info["grading"] == "", crashed.info
        played = asyncio.ensure_future(_play(stuck, ["sleep 300"], task))
        for _ in range(600):  # until the grading sandbox runs beside the agent's
            episode = stuck.episode
            if episode is not None and episode.grading_sandbox is not None and \
                    episode.grading_sandbox.state == "running":
                seen.append(episode.grading_sandbox)
                break
            await asyncio.sleep(0.05)
        assert seen, "no grading sandbox started while the agent ran"
        # the agent's sandbox, the grading one
        assert len([n for n in left_behind(root) if not n.startswith(".")]) == 2
        played.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await played
    finally:
        for env in (ok, crash, stuck):
            await env.close()
    assert seen[0].state == "stopped"
    assert left_behind(root) == []


async def test_a_grading_sandbox_that_cannot_start_is_a_sandbox_error_and_nothing_isleft_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend refuses the grading sandbox (as a cloud quota or a full disk would): the episode ends
    as ``sandbox_error`` with reward 0.0 and the backend's reason, never as a reward, and the agent's
    sandbox is removed."""
    require_backend("local")
    root = tmp_path / "sandboxes"
    monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(root))
    real_start = sandbox_mod.LocalSandbox._start

    async def refuse_grading(self: Any) -> None:
        if self.spec.labels.get("ares-gateway.role") == "grading":
            raise sandbox_mod.SandboxStartError("no room for another sandbox on this host")
        await real_start(self)

    monkeypatch.setattr(sandbox_mod.LocalSandbox, "_start", refuse_grading)
    task = _task(tmp_path / "tasks", "answer", ANSWER_TEST_SH)
    env = GatewayEnv(task=task, harness=TinyAgentHarness(), sandbox="local")
    try:
        ts = await _play(env, ["echo 42 > answer.txt"], task)
    finally:
        await env.close()
    assert ts.reward == 0.0
    assert ts.info["exit_reason"] == "sandbox_error", ts.info
    assert "grading sandbox failed" in ts.info["error"] and "no room for another sandbox" in ts.info[
        "error"], ts.info
    assert left_behind(root) == []


# ---------------------------------------------------------------------------------------------- rewards


def _reward_task(root: Path, name: str, written: str, toml_extra: str = "") -> Task:
    return _task(root, name, f"#!/bin/sh\nprintf '%s' '{written}' > $ARES_VERIFIER_DIR/reward.json\n",
                 toml_extra=toml_extra)


@pytest.mark.parametrize(("written", "extra", "error"), [
    ('{"tests": 1e308}', "", "reward 1e+308 is outside the task's range [0, 1]"),
    ("-1", "", "reward -1.0 is outside the task's range [0, 1]"),
    ('{"a": 2, "b": 0}', "", "reward 2.0 is outside the task's range [0, 1]: reward.json['a'] is 2.0"),
    ('{"a": 1e308, "b": 1e308}', "reward_range = [-1, 2]\n",
     "reward 1e+308 is outside the task's range [-1, 2]"),
    ('{"a": 2, "b": -1}', "reward_range = [-1, 2]\n", None),
    ('{"a": 1, "b": 0}', "", None),
])
async def test_a_reward_outside_the_tasks_range_is_a_verifier_error(
        written: str, extra: str, error: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(tmp_path / "sandboxes"))
    task = _reward_task(tmp_path / "tasks", "ranged", written, extra)
    async with sandbox_mod.LocalSandbox(task.sandbox_spec()) as sb:
        verdict = await run_tests(sb, task)
    if error is None:
        assert verdict.ok and verdict.reward.value == 0.5, verdict
    else:
        assert verdict.reward.value == 0.0 and verdict.error is not None and error in verdict.error, verdict
        assert "[verifier] reward_range" in verdict.error


def test_task_toml_grading_fields() -> None:
    cfg = parse_task_config("")
    assert cfg.grading == "fresh" and cfg.reward_range == (0.0, 1.0)
    cfg = parse_task_config('[verifier]\nsandbox = "agent"\nreward_range = [-1, 2.5]\n')
    assert cfg.grading == "agent" and cfg.reward_range == (-1.0, 2.5)
    for text, message in [
        ('[verifier]\nsandbox = "host"', r'\[verifier\] sandbox must be "fresh" or "agent", got \'host\''),
        ("[verifier]\nreward_range = [1, 0]", r"\[verifier\] reward_range must be two finite numbers"),
        ("[verifier]\nreward_range = [0, inf]", r"\[verifier\] reward_range must be two finite numbers"),
        ("[verifier]\nreward_range = 1", r"\[verifier\] reward_range must be two finite numbers"),
        ('[verifier]\nuser = "agent"', r"\[verifier\] user = 'agent' is the agent's user"),
        ('[verifier]\nuser = "1000"', r"\[verifier\] user = '1000' is the agent's user"),
        ('[agent]\nuser = "dev"\n[verifier]\nuser = "dev"', r"\[verifier\] user = 'dev' is the agent's user"),
    ]:
        with pytest.raises(TaskConfigError, match=message):
            parse_task_config(text)
    assert parse_task_config('[verifier]\nuser = "tester"').verifier_user == "tester"
