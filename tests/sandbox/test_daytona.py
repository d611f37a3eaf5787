"""Daytona specifics: what the real SDK sends (checked at the fake's HTTP boundary), sync removal, live
test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import sandbox
from bench.support.daytona_fake import API_KEY, DaytonaFake
from sandbox import DaytonaSandbox, SandboxSpec, janitor


async def test_create_carries_resources_labels_and_lifetimes(daytona_fake: DaytonaFake,
                                                             tmp_path: Path) -> None:
    spec = SandboxSpec(
        image="ares-gateway/agent-base:latest", workdir=str(tmp_path / "w"), env={"A": "1"},
        resources=sandbox.Resources(cpus=2, memory="3g", disk="10g"), labels={"task": "t1"},
        auto_stop_minutes=30, auto_delete_minutes=5,
    )
    async with DaytonaSandbox(spec, api_key=API_KEY, api_url=daytona_fake.api_url) as sb:
        body = daytona_fake.created[-1]
        assert body["name"] == f"ares-sbx-{sb.id}"
        assert (body["cpu"], body["memory"], body["disk"]) == (2, 3, 10)
        assert body["autoStopInterval"] == 30 and body["autoDeleteInterval"] == 5
        assert body["env"] == {"A": "1"}
        assert body["buildInfo"]["dockerfileContent"].startswith("FROM ares-gateway/agent-base:latest")
        labels = body["labels"]
        assert labels["task"] == "t1"
        assert labels[janitor.OWNER_LABEL] == janitor.owner_id()
        assert labels[janitor.SESSION_LABEL] == janitor.session_id()
        assert janitor.CREATED_LABEL in labels
        # Exec goes through the toolbox with a generous server-side backstop, never the 10 s default.
        await sb.exec("true", timeout=5)
        assert daytona_fake.exec_requests[-1]["timeout"] >= 60
    assert sb.remote_id in daytona_fake.deleted
    assert not daytona_fake.unknown_routes, daytona_fake.unknown_routes


async def test_dockerfile_spec_is_sent_as_build_info(daytona_fake: DaytonaFake, tmp_path: Path) -> None:
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM debian:bookworm-slim\nRUN echo hi\n")
    spec = SandboxSpec(dockerfile=dockerfile, workdir=str(tmp_path / "w"))
    async with DaytonaSandbox(spec, api_key=API_KEY, api_url=daytona_fake.api_url):
        assert daytona_fake.created[-1]["buildInfo"]["dockerfileContent"] == dockerfile.read_text()


async def test_sync_stop_and_remove_deletes_remotely(daytona_fake: DaytonaFake, tmp_path: Path) -> None:
    sb = DaytonaSandbox(SandboxSpec(workdir=str(tmp_path / "w")), api_key=API_KEY,
                        api_url=daytona_fake.api_url)
    await sb.start()
    assert sb in janitor.live_sandboxes()
    sb.stop_and_remove()  # what the janitor calls from atexit / signal handlers
    assert sb.remote_id in daytona_fake.deleted
    assert sb not in janitor.live_sandboxes()
    await sb.stop()  # still safe


def test_missing_api_key_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DAYTONA_API_KEY", raising=False)
    with pytest.raises(sandbox.BackendUnavailableError, match="DAYTONA_API_KEY"):
        DaytonaSandbox(SandboxSpec())


@pytest.mark.skipif(not os.environ.get("DAYTONA_API_KEY"),
                    reason="live Daytona test: set DAYTONA_API_KEY to run it")
async def test_live_daytona(tmp_path: Path) -> None:
    spec = SandboxSpec(workdir="/tmp/ares-live", auto_stop_minutes=5, auto_delete_minutes=0)
    src = tmp_path / "in.bin"
    src.write_bytes(os.urandom(100_000))
    async with DaytonaSandbox(spec) as sb:
        result = await sb.exec("echo out; echo err >&2; exit 3", timeout=60)
        assert (result.stdout, result.stderr, result.exit_code) == ("out\n", "err\n", 3)
        timed = await sb.exec("sleep 120", timeout=2)
        assert timed.timed_out
        await sb.upload_file(src, "in.bin")
        await sb.download_file("in.bin", tmp_path / "out.bin")
        assert (tmp_path / "out.bin").read_bytes() == src.read_bytes()
