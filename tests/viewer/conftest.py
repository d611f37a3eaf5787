"""The viewer's browser tests: Debian's Chromium (``.ci/provision-browser.sh``), driven by Playwright for
Python through ``executable_path`` (Playwright's own browser download is never used), started for a
closed network and pointed at 127.0.0.1 only; any request to another host is aborted and counted.

Screenshots of each page go to ``$ARES_VIEWER_SCREENSHOTS`` (default: the test session's tmp dir).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.prereq import require

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("ARES_CHROMIUM", "/usr/bin/chromium")
#: Always: without these Chromium reaches for outside hosts (updates, sync, name lookups).
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PROVISION = "bash .ci/provision-browser.sh"


def require_browser() -> None:
    require(os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK),
            f"no Chromium at {CHROMIUM}: run {PROVISION}")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        require(False, f"Playwright for Python is missing: pip install -e '.[test]' (then {PROVISION})")


def launch(playwright: Any, user_data_dir: str) -> Any:
    """A Chromium context on a fresh profile, for a closed network; requests off 127.0.0.1 are aborted."""
    context = playwright.chromium.launch_persistent_context(
        user_data_dir, executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS,
        viewport={"width": 1400, "height": 900})
    context.offsite = []  # type: ignore[attr-defined]

    def guard(route: Any) -> None:
        url = route.request.url
        if re.match(r"^http://127\.0\.0\.1:\d+/", url) or url.startswith(("data:", "about:")):
            route.continue_()
        else:
            context.offsite.append(url)  # type: ignore[attr-defined]
            route.abort()

    context.route("**/*", guard)
    return context


@pytest.fixture(scope="session")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = os.environ.get("ARES_VIEWER_SCREENSHOTS")
    path = Path(where) if where else tmp_path_factory.mktemp("viewer-screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One Chromium for the module's tests (a fresh page per test)."""
    require_browser()
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix="ares-viewer-chromium-")
    try:
        with sync_playwright() as pw:
            context = launch(pw, profile)
            try:
                yield context
                assert context.offsite == [], f"the page asked for other hosts: {context.offsite}"
            finally:
                context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    p = browser.new_page()
    p.dialogs = []
    p.on("dialog", lambda d: (p.dialogs.append(d.message), d.dismiss()))
    p.errors = []
    p.on("pageerror", lambda e: p.errors.append(str(e)))
    try:
        yield p
    finally:
        p.close()


class ViewProcess:
    """``ares-gateway view DIR`` as a subprocess (the real CLI), and its URL."""

    def __init__(self, directory: Path, *extra: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ares_gateway.cli", "view", str(directory), "--port", "0",
             *extra], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        found = re.search(r"(http://127\.0\.0\.1:\d+/ui/)#token=([A-Za-z0-9_-]+)", line)
        if not found:
            self.proc.kill()
            raise AssertionError(
                f"view printed no URL: {line!r} {self.proc.stderr.read() if self.proc.stderr else ''}")
        #: The pages' URL, and the printed one that logs in (its token in the fragment).
        self.url, self.token = found.group(1), found.group(2)
        self.login_url = f"{self.url}#token={self.token}"

    def open(self, page: Any) -> None:
        """Open the printed URL, as a person would: the page logs in with the fragment's token."""
        page.goto(self.login_url)
        page.wait_for_selector("#episodes", state="attached")
        assert page.url == self.url and self.token not in page.url

    def stop(self) -> str:
        self.proc.terminate()
        try:
            _, err = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return err


def expect(locator: Any) -> Any:
    """Playwright's ``expect`` (polls from Python: the page's CSP forbids the eval ``wait_for_function``
    uses)."""
    from playwright.sync_api import expect as _expect

    return _expect(locator)


def shot(page: Any, screenshots: Path, name: str) -> None:
    page.screenshot(path=str(screenshots / f"{name}.png"), full_page=False)
