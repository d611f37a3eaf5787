"""Saved workspaces and ``ares-gateway reverify``, over real episodes in real sandboxes.

* ``run examples-tiny --policy oracle`` saves each episode's workdir as ``workspaces/<task>.<attempt>.tar``
  (the archive grading made), and ``reverify`` grades each again in a fresh sandbox: 1.0 beside 1.0,
  exit status 0, ``reverify.json`` written; ``--no-save-workspaces`` saves none;
* a reward that depended on a process the agent left running (``[verifier] sandbox = "agent"``)
  does not reproduce, and the report says what differs (the reward, the verifier's output);
* a workdir over the cap is saved cut (a whole archive within the cap), and says so;
* bad input: a run from before saved workspaces, a run stopped midway (no results.json, a line of
  episodes.jsonl cut short, a damaged archive, a half-written ``.part``), a task no longer found, no run
  directory at all: one clear line each, the other episodes still re-verified, never a traceback;
* the archive checks themselves: a tar cut at any byte is told from a whole one, and cut to its whole
  members.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from ares_gateway import EpisodeConfig, RunConfig
from ares_gateway.episodes.reverify import RunDirError, reverify_run
from ares_gateway.episodes.rollouts import run_rollouts
from ares_gateway.episodes.tasks import Task, load_dataset
from ares_gateway.episodes.workspaces import check_archive, cut_archive
from ares_gateway.policies import make_policy
from tests.prereq import docker_ok, image_present, require, require_hardened_local
from tests.rollouts.e2e import AGENTS_IMAGE, REPO
from tests.security.test_exploits import task_dir

EXAMPLES = ("fix-median-bug", "make-slug-tests-pass", "summarize-sales-csv", "write-greeting-file")


def _cli(*args: str, env: dict[str, str], timeout: float = 400) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ares_gateway.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def _env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "ARES_SANDBOX_LOCAL_ROOT": str(tmp / "sandboxes"), "PYTHONUNBUFFERED": "1",
            "COLUMNS": "250"}


def _no_traceback(proc: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def oracle_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One ``ares-gateway run examples-tiny --policy oracle`` on the local backend (the 4 bundled tasks)."""
    require_hardened_local()
    tmp = tmp_path_factory.mktemp("oracle")
    out = tmp / "run"
    proc = _cli("run", "examples-tiny", "--policy", "oracle", "--sandbox", "local", "-n", "4",
                "--out", str(out), "--stats", "null", env=_env(tmp))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def _copy(run: Path, tmp: Path, name: str) -> Path:
    dst = tmp / name
    shutil.copytree(run, dst, ignore=shutil.ignore_patterns("gateway-data", "reverify.json"))
    return dst


def _results(run: Path) -> dict[str, Any]:
    return json.loads((run / "results.json").read_text())


def _by_key(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f"{e['task']}.{e['attempt']}": e for e in report["episodes"]}


def test_the_oracles_rewards_reproduce(oracle_run: Path, tmp_path: Path) -> None:
    doc = _results(oracle_run)
    assert sorted(e["task"] for e in doc["episodes"]) == list(EXAMPLES)
    assert doc["run"]["save_workspaces"] is True
    for e in doc["episodes"]:
        assert e["reward"] == 1.0 and e["grading"] == "fresh", e
        assert e["workspace"] == f"workspaces/{e['task']}.0.tar", e
        archive = oracle_run / e["workspace"]
        assert archive.stat().st_size == e["workspace_bytes"] > 0 and e["workspace_truncated"] is False
        assert check_archive(archive) is None
        assert Path(e["task_dir"]).is_dir()
    with tarfile.open(oracle_run / "workspaces" / "write-greeting-file.0.tar") as tar:
        assert any(n.endswith("greeting.txt") for n in tar.getnames()), tar.getnames()
    # episodes.jsonl carries the same fields (what a stopped run leaves)
    lines = [json.loads(x) for x in (oracle_run / "episodes.jsonl").read_text().splitlines()]
    assert all(x["workspace"] and x["workspace_bytes"] for x in lines)
    assert not list((oracle_run / "workspaces").glob("*.part"))

    run = _copy(oracle_run, tmp_path, "run")
    proc = _cli("reverify", str(run), "--sandbox", "local", "-n", "4", env=_env(tmp_path))
    _no_traceback(proc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "4 episode(s): 4 agree, 0 differ, 0 error, 0 skipped" in proc.stdout, proc.stdout
    for task in EXAMPLES:
        row = next(line for line in proc.stdout.splitlines() if task in line and "agree" in line)
        assert row.count("1.000") == 2, row  # recorded and now, side by side
    report = json.loads((run / "reverify.json").read_text())
    assert report["summary"]["agree"] == 4 and report["summary"]["exit_code"] == 0
    for e in report["episodes"]:
        assert e["status"] == "agree" and e["recorded_reward"] == e["reward"] == 1.0, e
        assert e["recorded_parts"] == e["parts"]
    assert not (tmp_path / "sandboxes").exists() or not list((tmp_path / "sandboxes").iterdir())


ANSWER_TEST_SH = ("#!/bin/sh\nif [ \"$(cat answer.txt 2>/dev/null)\" = 42 ]; then echo 1; else echo 0; fi "
                  "> $ARES_VERIFIER_DIR/reward.txt\n")
# A service the agent starts and leaves running; the tests ask it for the answer.
SERVE = ("echo 42 > answer.txt && setsid nohup python3 -m http.server 8643 --bind 127.0.0.1 >/dev/null 2>&1 "
         "< /dev/null & sleep 1; echo served")
SERVICE_TEST_SH = (
    "#!/bin/sh\n"
    "got=$(python3 -c \"import urllib.request as u; "
    "print(u.urlopen('http://127.0.0.1:8643/answer.txt', timeout=5).read().decode().strip())\" 2>&1 "
    "| tail -n 1)\n"
    "echo \"service said: $got\"\n"
    "if [ \"$got\" = 42 ]; then echo 1; else echo 0; fi > $ARES_VERIFIER_DIR/reward.txt\n"
)


async def _scripted(task: Task, commands: list[str], out: Path, **kw: Any) -> Any:
    return await run_rollouts(
        [task], policy=make_policy("scripted", commands=commands),
        episode=EpisodeConfig("tiny-agent", sandbox="local", time_limit=120),
        run=RunConfig(out=out, stats="null", **kw),
    )


async def test_a_reward_that_needed_the_agents_running_service_does_not_reproduce(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_hardened_local()
    monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(tmp_path / "sandboxes"))
    task = Task.load(task_dir(tmp_path / "tasks", "agent-service", test_sh=SERVICE_TEST_SH, workspace=True,
                              toml_extra='sandbox = "agent"\n'))
    out = tmp_path / "run"
    summary = await _scripted(task, [SERVE], out)
    [e] = summary.episodes
    assert e.grading == "agent" and e.reward == 1.0, (e.exit_reason, e.error)
    assert e.workspace == "workspaces/agent-service.0.tar" and e.workspace_bytes  # saved in agent mode too
    report = await reverify_run(out, sandbox="local")
    [c] = report.episodes
    assert c.status == "differ" and c.recorded_reward == 1.0 and c.reward == 0.0, c
    assert "reward 1 recorded, 0 now" in (c.note or ""), c.note
    assert c.output_tail is not None and "service said:" in c.output_tail
    assert "service said: 42" not in c.output_tail
    assert c.recorded_output_tail is not None and "service said: 42" in c.recorded_output_tail
    assert report.exit_code == 1
    saved = json.loads((out / "reverify.json").read_text())
    assert saved["summary"]["differ"] == 1 and saved["episodes"][0]["differences"]


async def test_a_workspace_over_the_cap_is_cut_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    require_hardened_local()
    monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(tmp_path / "sandboxes"))
    task = Task.load(task_dir(tmp_path / "tasks", "huge", test_sh=ANSWER_TEST_SH, workspace=True,
                              toml_extra="[environment]\nstorage_mb = 64\n"))
    out = tmp_path / "run"
    cap = 64 * 1024 * 1024
    with caplog.at_level(logging.WARNING, logger="ares_gateway.episodes.workspaces"):
        summary = await _scripted(task, ["echo 42 > answer.txt && truncate -s 100M big.bin && ls -la"], out)
    [e] = summary.episodes
    assert e.exit_reason == "completed" and "too large to grade" in (e.error or ""), (e.exit_reason, e.error)
    assert e.workspace_truncated is True and e.workspace == "workspaces/huge.0.tar", e
    archive = out / e.workspace
    assert check_archive(archive) is None  # cut, but a whole archive
    assert archive.stat().st_size == e.workspace_bytes <= cap
    assert any("workspace of huge truncated: the workdir passes the cap of 67108864 bytes" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    entry = _results(out)["episodes"][0]
    assert entry["workspace_truncated"] is True
    assert json.loads((out / "episodes.jsonl").read_text().splitlines()[0])["workspace_truncated"] is True
    assert not list((out / "workspaces").glob("*.part"))
    report = await reverify_run(out, sandbox="local")
    [c] = report.episodes
    assert c.workspace_truncated and "cut at the cap" in (c.note or ""), c


async def test_no_save_workspaces_saves_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_hardened_local()
    monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(tmp_path / "sandboxes"))
    task = Task.load(task_dir(tmp_path / "tasks", "answer", test_sh=ANSWER_TEST_SH, workspace=True))
    out = tmp_path / "run"
    summary = await _scripted(task, ["echo 42 > answer.txt"], out, save_workspaces=False)
    [e] = summary.episodes
    assert e.reward == 1.0 and e.workspace is None and not (out / "workspaces").exists()
    report = await reverify_run(out, sandbox="local")
    [c] = report.episodes
    assert c.status == "error" and c.note == "no saved workspace: the run ran with --no-save-workspaces", c
    assert report.exit_code == 1


async def test_trainers_play_episodes_saves_workspaces_only_when_asked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ares_gateway.trainers import play_episodes

    require_hardened_local()
    monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(tmp_path / "sandboxes"))
    greeting = {t.name: t for t in load_dataset("examples").tasks}["write-greeting-file"]
    for save, out in ((False, tmp_path / "default"), (True, tmp_path / "asked")):
        kwargs = {"save_workspaces": True} if save else {}
        [e] = await play_episodes(
            [greeting], policy=make_policy("oracle"), episode=EpisodeConfig("tiny-agent", sandbox="local"),
            run=RunConfig(out=str(out), **kwargs),
        )
        assert e.reward == 1.0, e.error
        folder = out / "workspaces"
        saved = sorted(p.name for p in folder.glob("*")) if folder.exists() else []
        assert saved == (["write-greeting-file.0.tar"] if save else []), saved


def test_bad_input_is_one_line_per_episode_and_the_rest_still_reverified(oracle_run: Path,
                                                                          tmp_path: Path) -> None:
    env = _env(tmp_path)
    # A run from before saved workspaces: its entries name neither a workspace nor a task directory.
    old = _copy(oracle_run, tmp_path, "old")
    shutil.rmtree(old / "workspaces")
    doc = _results(old)
    for e in doc["episodes"]:
        for k in ("workspace", "workspace_bytes", "workspace_truncated", "workspace_error", "workspace_uid",
                  "task_dir"):
            e.pop(k)
    (old / "results.json").write_text(json.dumps(doc))
    proc = _cli("reverify", str(old), "--sandbox", "local", env=env)
    _no_traceback(proc)
    assert proc.returncode == 1, proc.stdout
    report = json.loads((old / "reverify.json").read_text())
    assert report["summary"]["error"] == 4
    assert all(e["note"].startswith("no saved workspace: the run predates saved workspaces")
               for e in report["episodes"])

    # A run stopped midway: no results.json, its last jsonl line cut short, one archive cut short, one
    # archive still a .part, one task whose directory is gone; the remaining episode still re-verified.
    cut = _copy(oracle_run, tmp_path, "stopped")
    (cut / "results.json").unlink()
    lines = (cut / "episodes.jsonl").read_text().splitlines()
    entries = {json.loads(x)["task"]: json.loads(x) for x in lines}
    entries["summarize-sales-csv"]["task_dir"] = str(tmp_path / "no-such-task")
    order = ["summarize-sales-csv", "fix-median-bug", "make-slug-tests-pass", "write-greeting-file"]
    text = "\n".join(json.dumps(entries[t]) for t in order) + "\n"
    text += json.dumps(entries["write-greeting-file"])[:40]  # a last line cut short
    (cut / "episodes.jsonl").write_text(text)
    damaged = cut / "workspaces" / "fix-median-bug.0.tar"
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2 + 100])
    half = cut / "workspaces" / "make-slug-tests-pass.0.tar"
    half.rename(half.with_name(half.name + ".part"))
    proc = _cli("reverify", str(cut), "--sandbox", "local", "--log-level", "DEBUG", env=env)
    _no_traceback(proc)
    assert proc.returncode == 1, proc.stdout
    assert "note: no results.json: the run was stopped before its end" in proc.stdout, proc.stdout
    assert "episodes.jsonl line 5 is not JSON" in proc.stdout, proc.stdout
    report = _by_key(json.loads((cut / "reverify.json").read_text()))
    assert report["write-greeting-file.0"]["status"] == "agree", report["write-greeting-file.0"]
    assert report["fix-median-bug.0"]["status"] == "error"
    assert report["fix-median-bug.0"]["note"].startswith(
        "the saved workspace workspaces/fix-median-bug.0.tar is damaged: ")
    assert report["make-slug-tests-pass.0"]["note"] == (
        "the saved workspace workspaces/make-slug-tests-pass.0.tar is missing; "
        "make-slug-tests-pass.0.tar.part is there: the run was stopped while saving it")
    note = report["summarize-sales-csv.0"]["note"]
    assert note.startswith("task 'summarize-sales-csv' is not found: its recorded directory "), note
    assert "--tasks" in note
    # --tasks finds it by name
    proc = _cli("reverify", str(cut), "--sandbox", "local", "--tasks", "examples", env=env)
    _no_traceback(proc)
    again = _by_key(json.loads((cut / "reverify.json").read_text()))
    assert again["summarize-sales-csv.0"]["status"] == "agree", again["summarize-sales-csv.0"]

    # No run directory at all: exit status 2, one line.
    for bad in (tmp_path / "nothing-here", tmp_path):
        proc = _cli("reverify", str(bad), env=env)
        _no_traceback(proc)
        assert proc.returncode == 2 and proc.stderr.startswith("ares-gateway reverify: "), proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    with pytest.raises(RunDirError, match=r"neither results\.json nor episodes\.jsonl"):
        asyncio.run(reverify_run(tmp_path))


def _tar(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_a_tar_cut_at_any_byte_is_told_from_a_whole_one_and_cut_to_its_whole_members(tmp_path: Path) -> None:
    whole = _tar({"a.txt": b"a" * 700, "b/c.txt": b"c" * 3000, "d.bin": os.urandom(20000)})
    src, dst = tmp_path / "src.tar", tmp_path / "dst.tar"
    src.write_bytes(whole)
    assert check_archive(src) is None
    for at in (0, 100, 512, 1024, 2048, 3584, 5000, 6144, len(whole) - 10240, len(whole) - 1):
        src.write_bytes(whole[:at])
        assert check_archive(src) is not None, at
        size, kept = cut_archive(src, dst, limit=1 << 20)
        assert check_archive(dst) is None and size == dst.stat().st_size
        with tarfile.open(dst) as tar:
            names = tar.getnames()
            assert len(names) == kept
            for m in tar.getmembers():  # every member kept is whole
                data = tar.extractfile(m)
                assert data is not None and len(data.read()) == m.size
    # a limit keeps only what fits
    src.write_bytes(whole)
    size, kept = cut_archive(src, dst, limit=20480)
    assert size <= 20480 and kept == 2 and check_archive(dst) is None


@pytest.mark.docker
@pytest.mark.slow
def test_docker_oracle_run_reproduces(tmp_path: Path) -> None:
    require(docker_ok(), "no Docker engine answers: run bash .ci/provision-docker.sh", docker=True)
    require(image_present(AGENTS_IMAGE),
            f"the image {AGENTS_IMAGE} is missing: run bash .ci/provision-agents.sh", docker=True)
    out = tmp_path / "run"
    env = _env(tmp_path)
    proc = _cli("run", "examples-tiny:write-greeting-file,make-slug-tests-pass", "--policy", "oracle",
                "--sandbox", "docker", "--out", str(out), "--stats", "null", env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert all(e["workspace"] for e in _results(out)["episodes"])
    proc = _cli("reverify", str(out), env=env)  # the run's own backend: docker
    _no_traceback(proc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "reverify.json").read_text())
    assert report["sandbox"] == "docker" and report["summary"]["agree"] == 2


async def test_the_streaming_source_saves_workspaces_too(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    require_hardened_local()
    from ares_gateway import RolloutSource
    from ares_gateway.episodes.tasks import load_dataset

    monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(tmp_path / "sandboxes"))
    out = tmp_path / "run"
    task = load_dataset("examples").task("write-greeting-file")
    source = RolloutSource(
        [task], policy=make_policy("oracle"), episode=EpisodeConfig("tiny-agent", sandbox="local"),
        run=RunConfig(attempts=2, out=out, stats="null"),
    )
    try:
        groups = [g async for g in source.groups()]
    finally:
        await source.close()
    assert [g.rewards for g in groups] == [[1.0, 1.0]]
    assert sorted(p.name for p in (out / "workspaces").iterdir()) == [
        "write-greeting-file.0.tar", "write-greeting-file.1.tar"]
    report = await reverify_run(out, sandbox="local")
    assert [c.status for c in report.episodes] == ["agree", "agree"], [c.note for c in report.episodes]
