"""The viewer live, in a real browser: mounted at ``/ui/`` on a running gateway as ``run`` mounts it, an
episode driven turn by turn (the ``openai`` SDK as the agent, the policy in process) shows each new turn
within a second, and the run table shows episodes as they end; and ``serve``'s ``/ui/`` is closed
without the admin token, whose login sets an HttpOnly SameSite cookie and leaves the token in no URL
and no log line."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from ares_gateway import Gateway
from ares_gateway.episodes.output import EpisodeResult, RunOutputs
from ares_gateway.viewer import mount_viewer

from .conftest import CHROMIUM, CHROMIUM_FLAGS, REPO, require_browser
from .runs import Agent


async def _launch(pw: Any, profile: str) -> Any:
    context = await pw.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True,
                                                          args=CHROMIUM_FLAGS, viewport={"width": 1400, "height": 900})
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
            mount_viewer(gw, out)  # as `run` does
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
            await agent.client.close()
            assert context.offsite == []
            await context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def _get(url: str, *, data: bytes | None = None, cookie: str | None = None) -> tuple[int, Any]:
    opener = urllib.request.build_opener(_NoRedirect)
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    if cookie:
        req.add_header("Cookie", cookie)
    try:
        with opener.open(req, timeout=10) as resp:
            return resp.status, resp.headers
    except urllib.error.HTTPError as err:
        return err.code, err.headers


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_serve_ui_needs_the_admin_token(tmp_path: Path, screenshots: Path) -> None:
    require_browser()
    from playwright.async_api import async_playwright

    token = "viewer-test-admin-token-" + "x7Q2" * 8
    (tmp_path / "token").write_text(token + "\n")
    (tmp_path / "token").chmod(0o600)
    proc = subprocess.Popen([sys.executable, "-m", "ares_gateway.cli", "serve", "--port", "0", "--data-dir",
                             str(tmp_path / "data"), "--admin-token-file", str(tmp_path / "token"), "--access-log",
                             "--log-level", "DEBUG"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(tmp_path)})
    profile = tempfile.mkdtemp(prefix="ares-viewer-chromium-")
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        found = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        assert found, line
        url = found.group(1)
        assert f"trajectory viewer: {url}/ui/" in proc.stdout.readline()
        # Closed without the token: pages redirect to the login, the API answers 401.
        status, headers = _get(url + "/ui/")
        assert status == 303 and headers["location"] == "/ui/login"
        assert _get(url + "/ui/api/run")[0] == 401
        assert _get(url + "/ui/api/episode?key=x")[0] == 401
        assert _get(url + "/ui/login", data=b"token=wrong")[0] == 401
        # The login: the token in a form body, a cookie back (a random id, HttpOnly, SameSite=Strict).
        status, headers = _get(url + "/ui/login", data=urllib.parse.urlencode({"token": token}).encode())
        assert status == 303
        cookie = headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/ui" in cookie and token not in cookie
        assert _get(url + "/ui/api/run", cookie=cookie.split(";")[0])[0] == 200
        # In the browser: the login form, then the pages; the token in no URL it asked for.
        async with async_playwright() as pw:
            context = await _launch(pw, profile)
            page = await context.new_page()
            urls: list[str] = []
            page.on("request", lambda r: urls.append(r.url))
            await _login(page, url, token)
            await page.screenshot(path=str(screenshots / "serve-ui.png"))
            assert await page.evaluate("document.cookie") == ""  # HttpOnly: no script reads it
            history = await page.evaluate("[location.href, document.referrer]")
            assert urls and not any(token in u for u in [*urls, *history])
            assert context.offsite == []
            await context.close()
    finally:
        proc.terminate()
        stdout, stderr = proc.communicate(timeout=20)
        shutil.rmtree(profile, ignore_errors=True)
    logged = line + stdout + stderr
    assert "/ui/login" in logged  # the access log was on
    assert token not in logged
