"""``serve``'s viewer at ``/ui/`` (the real CLI): closed without the admin token; the login (the token in a
form body) sets an HttpOnly, SameSite=Strict cookie, and the token is in no URL the browser asked for,
nowhere in its history, and in no line the server logged (with ``--access-log`` and DEBUG logging)."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from .conftest import REPO, shot


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


def test_serve_ui_needs_the_admin_token(tmp_path: Path, page: Any, screenshots: Path) -> None:
    token = "viewer-test-admin-token-" + "x7Q2" * 8
    (tmp_path / "token").write_text(token + "\n")
    (tmp_path / "token").chmod(0o600)
    proc = subprocess.Popen([sys.executable, "-m", "ares_gateway.cli", "serve", "--port", "0", "--data-dir",
                             str(tmp_path / "data"), "--admin-token-file", str(tmp_path / "token"),
                             "--access-log", "--log-level", "DEBUG"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(tmp_path)})
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
        assert ("HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/ui" in cookie
                and token not in cookie)
        assert _get(url + "/ui/api/run", cookie=cookie.split(";")[0])[0] == 200
        # In the browser: the login form, then the pages; the token in no URL it asked for.
        urls: list[str] = []
        page.on("request", lambda r: urls.append(r.url))
        page.goto(url + "/ui/")
        assert page.url.endswith("/ui/login")
        page.fill("input[name=token]", token)
        page.click("button[type=submit]")
        page.wait_for_selector("#episodes", state="attached")
        shot(page, screenshots, "serve-ui")
        assert page.evaluate("document.cookie") == ""  # HttpOnly: no script reads it
        history = page.evaluate("[location.href, document.referrer, String(history.length)]")
        assert urls and not any(token in u for u in [*urls, *history])
    finally:
        proc.terminate()
        stdout, stderr = proc.communicate(timeout=20)
    logged = line + stdout + stderr
    assert "/ui/login" in logged  # the access log was on
    assert token not in logged
