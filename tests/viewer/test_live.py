"""The viewer live, in a real browser: mounted at ``/ui/`` on a running gateway as ``run`` mounts it, an
episode driven turn by turn (the ``openai`` SDK as the agent, the policy in process) shows each new turn
within a second, and the run table shows episodes as they end."""

from __future__ import annotations

import re
import shutil
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from ares_gateway import Gateway
from ares_gateway.episodes.output import EpisodeResult, RunOutputs
from ares_gateway.viewer import mount_viewer
from bench.support.viewer_runs import Agent

from .conftest import CHROMIUM, CHROMIUM_FLAGS, require_browser


async def _launch(pw: Any, profile: str) -> Any:
    context = await pw.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True,
                                                          args=CHROMIUM_FLAGS,
                                                          viewport={"width": 1400, "height": 900})
    offsite: list[str] = []

    async def guard(route: Any) -> None:
        if re.match(r"^http://127\.0\.0\.1:\d+/", route.request.url):
            await route.continue_()
        else:
            offsite.append(route.request.url)
            await route.abort()

    await context.route("**/*", guard)
    context.offsite = offsite
    return context


async def _login(page: Any, url: str, token: str) -> None:
    await page.goto(url + "/ui/")
    assert page.url.endswith("/ui/login")
    await page.fill("input[name=token]", token)
    await page.click("button[type=submit]")
    await page.wait_for_selector("#episodes")


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_live_episode_and_run_table(tmp_path: Path, screenshots: Path) -> None:
    require_browser()
    from playwright.async_api import async_playwright, expect

    out = tmp_path / "run"
    outputs = RunOutputs(out)
    profile = tempfile.mkdtemp(prefix="ares-viewer-chromium-")
    try:
        async with Gateway(data_dir=str(out / "gateway-data")) as gw, async_playwright() as pw:
            viewer = mount_viewer(gw, out)  # as `run` does
            info = await gw.create_session(metadata={"task": "live-task", "attempt": 0})
            agent = Agent(gw, info)
            context = await _launch(pw, profile)
            page = await context.new_page()
            await _login(page, gw.url, gw.admin_token)
            await expect(page.locator("#episodes tbody tr")).to_have_count(1)
            assert "running" in await page.inner_text("#episodes tbody")
            await page.goto(gw.url + "/ui/#/e/" + urllib.parse.quote("session:" + info.session_id, safe=""))
            await page.wait_for_selector("#turns", state="attached")
            messages: list[dict[str, Any]] = [{"role": "system", "content": "agent"},
                                              {"role": "user", "content": "Fix the bug."}]
            took = []
            for i in range(4):
                t0 = time.monotonic()
                reply = await agent.turn(messages, f"step {i}: looking at file{i}.py")
                await expect(page.locator("#turns .turn")).to_have_count(i + 1, timeout=1000)
                took.append(time.monotonic() - t0)
                assert f"step {i}: looking at file{i}.py" in await page.inner_text("#turns .turn >> nth=-1")
                messages = [*messages, {"role": "assistant", "content": reply},
                            {"role": "user", "content": f"output of step {i}"}]
            assert max(took) < 1.0, took
            print(f"new turns shown after {[round(t, 3) for t in took]} s")
            await page.screenshot(path=str(screenshots / "episode-live.png"))
            # The run table: a finished episode written by the run appears, the live one ends; within 1 s.
            await page.goto(gw.url + "/ui/#/")
            await expect(page.locator("#episodes tbody tr")).to_have_count(1)
            t0 = time.monotonic()
            outputs.episode(EpisodeResult(task="done-task", attempt=0, reward=1.0, turns=3, duration=12.0,
                                          exit_reason="completed"), [], [], {})
            await expect(page.locator("#episodes tbody tr")).to_have_count(2, timeout=1000)
            await gw.end_session(info.session_id, reward=1.0)
            await expect(page.locator("#episodes tbody tr.live")).to_have_count(0, timeout=1000)
            assert time.monotonic() - t0 < 2.0
            await page.screenshot(path=str(screenshots / "run-live.png"))
            # As the driver does: the episode's row and files written, its session gone from the gateway;
            # the running episode's key still finds it (an open page keeps working).
            outputs.episode(EpisodeResult(task="live-task", attempt=0, reward=1.0, turns=4, duration=3.0,
                                          exit_reason="completed", session_id=info.session_id),
                            gw.trajectory(info.session_id), gw.turn_log(info.session_id), {})
            await gw.delete_session(info.session_id)
            ended = viewer.source.episode("session:" + info.session_id)
            assert ended["episode"]["key"] == "live-task.0" and ended["turns"] == 4 and len(
                ended["samples"]) == 1
            # Its tree now comes from the run's data dir, which the gateway created after the viewer was
            # mounted.
            tree = viewer.source.tree("session:" + info.session_id)["tree"]
            assert tree is not None and tree["leaves"] == 1
            await expect(page.locator("#episodes tbody tr")).to_have_count(2, timeout=1000)
            await agent.client.close()
            assert context.offsite == []
            await context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)
