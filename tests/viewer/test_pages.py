"""The viewer's pages in a real browser, served by the real ``ares-gateway view`` on run directories made
by real runs: the demo's oracle part (mini-swe-agent on the bundled examples), the model part when the
model extra is there, and an in-process run of a real gateway with a forked session and hostile output."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.support.viewer_runs import INJECTIONS, build_run, forked_session, injection_session
from tests.helpers import cli
from tests.rollouts.e2e import REPO, require_mini

from .conftest import ViewProcess, expect, shot

HOSTILE_TASK = "hostile<img src=x onerror=alert(1)>"


def _env(boxes: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
    env.update(ARES_SANDBOX_LOCAL_ROOT=str(boxes), DOCKER_HOST="unix:///nonexistent.sock",
               PYTHONPATH=str(REPO))
    return env


def _llama() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except Exception:
        return False
    return True


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | None]:
    """The demo's parts, once per module: the oracle (4 examples solved by mini-swe-agent in local
    sandboxes), and, with the model extra, SmolLM2 on llama.cpp (1 task, 2 LLM calls) for real samples."""
    import subprocess

    require_mini("local")
    base = tmp_path_factory.mktemp("real-run")
    if _llama():
        args = cli("demo", "--out", str(base / "demo"), "--model-tasks", "1", "--model-steps", "2")
        out: dict[str, Path | None] = {"oracle": base / "demo" / "oracle", "model": base / "demo" / "model"}
    else:
        args = cli("run", "examples-mswea", "--policy", "oracle", "--sandbox", "local", "--out",
                   str(base / "oracle"))
        out = {"oracle": base / "oracle", "model": None}
    proc = subprocess.run(args, cwd=REPO, env=_env(base / "boxes"), capture_output=True, text=True,
                          timeout=400, check=False)
    oracle = out["oracle"]
    assert oracle is not None and (oracle / "results.json").is_file(), proc.stdout[-3000:] + proc.stderr[
        -3000:]
    # `run` (and the demo's parts) served the viewer live on the gateway's port while it ran.
    assert re.search(r"trajectory viewer: http://127\.0\.0\.1:\d+/ui/", proc.stdout), proc.stdout[-3000:]
    return out


@pytest.fixture(scope="module")
def tree_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An in-process run of a real gateway: a forked session with a side call, and a hostile one."""
    out = tmp_path_factory.mktemp("tree-run") / "run"
    run = build_run(out, [("fix-median", 1.0, forked_session), (HOSTILE_TASK, 0.0, injection_session)],
                    error={HOSTILE_TASK: "<script>window.__pwned='error'</script> \x1b[1mboom\x1b[0m"})
    # On a thread of its own: sync Playwright keeps an event loop running on this one.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, run).result()


@pytest.fixture(scope="module")
def tree_view(tree_run: Path) -> Iterator[ViewProcess]:
    view = ViewProcess(tree_run)
    yield view
    assert view.token not in view.stop()  # printed once, for the person who started it; never logged


def _rows(page: Any) -> dict[str, list[str]]:
    page.wait_for_selector("#episodes tbody tr")
    out = {}
    for tr in page.query_selector_all("#episodes tbody tr"):
        cells = [td.inner_text() for td in tr.query_selector_all("td")]
        out[cells[0]] = cells
    return out


# ---------------------------------------------------------------------- a real run


@pytest.mark.slow
def test_real_run_pages(real_run: dict[str, Path | None], browser: Any, page: Any, screenshots: Path) -> None:
    oracle = real_run["oracle"]
    assert oracle is not None
    doc = json.loads((oracle / "results.json").read_text())
    view = ViewProcess(oracle)
    try:
        view.open(page)
        rows = _rows(page)
        # Every episode with its reward.
        assert len(rows) == len(doc["episodes"]) == 4
        for e in doc["episodes"]:
            key = f"{e['task']}.{e['attempt']}"
            assert key in rows, (key, list(rows))
            assert float(rows[key][3]) == e["reward"]
        assert page.inner_text("#summary").count("1.000") >= 2  # mean reward and pass@1
        shot(page, screenshots, "run")
        # An episode shows its turns, as the turn log has them.
        first = doc["episodes"][0]
        key = f"{first['task']}.{first['attempt']}"
        logged = (oracle / "turns" / f"{key}.jsonl").read_text().splitlines()
        page.click(f"a.ep-link:text-is('{key}')")
        page.wait_for_selector("#turns .turn")
        expect(page.locator("#turns .turn")).to_have_count(len(logged))
        assert page.inner_text("#turn-count") == str(len(logged))
        assert "policy answered" in page.inner_text("#turns").lower()
        assert "PASSED" in page.inner_text("#verifier") or page.inner_text("#verifier").strip()
        shot(page, screenshots, "episode")
    finally:
        view.stop()


@pytest.mark.slow
def test_real_model_sample(real_run: dict[str, Path | None], page: Any, screenshots: Path) -> None:
    model = real_run["model"]
    if model is None:
        pytest.skip(
            "the model extra (llama_cpp) is not installed: the sample checks run on the in-process run")
    files = sorted((model / "trajectories").glob("*.jsonl"))
    found = [(f.stem, i, json.loads(line)) for f in files for i,
             line in enumerate(f.read_text().splitlines())]
    assert found, "the model part wrote no sample"
    key, index, sample = found[0]
    view = ViewProcess(model)
    try:
        view.open(page)
        _check_sample_page(page, view.url, key, index, sample)
        shot(page, screenshots, "sample-model")
        # Its tree, rebuilt from the run's turn log (the run removed the session from its data dir).
        page.goto(f"{view.url}#/e/{key}/tree")
        page.wait_for_selector("#tree .node")
        assert f"sample {index}" in page.inner_text("#tree")
        shot(page, screenshots, "tree-model")
    finally:
        view.stop()


def _check_sample_page(page: Any, url: str, key: str, index: int, sample: dict[str, Any]) -> None:
    page.goto(f"{url}#/e/{key}/s/{index}")
    page.wait_for_selector("#tokens .tok")
    # The count of trained tokens is the loss mask's sum; the trained tokens are marked.
    assert int(page.inner_text("#trained-count")) == sum(sample["loss_mask"])
    shown = page.eval_on_selector_all("#tokens .tok.trained", "els => els.length")
    prompt = len(sample["tokens"]) - sample["response_length"]
    window = min(len(sample["tokens"]), 2000)
    assert shown == sum(sample["loss_mask"][: max(0, window - prompt)])
    # Every token has a box to hover, a line break too (a bare "\n" span has none: shown as ↵).
    boxless = page.eval_on_selector_all(
        "#tokens .tok",
        "els => els.filter(e => e.getBoundingClientRect().width === 0).map(e => e.dataset.id)")
    assert boxless == []
    # Hovering a trained token shows its id and logprob.
    first = sample["loss_mask"].index(1)
    tok = page.query_selector_all("#tokens .tok")[prompt + first]
    tok.hover()
    page.wait_for_selector("#tip:not([hidden])")
    tip = page.inner_text("#tip")
    assert f"id {sample['tokens'][prompt + first]}" in tip
    assert f"logprob {sample['logprobs'][first]:.4f}" in tip
    # Low-probability tokens are marked, exactly those below p = 0.1.
    lows = page.eval_on_selector_all("#tokens .tok.low", "els => els.length")
    want = sum(1 for m,
               lp in zip(sample["loss_mask"][: max(0, window - prompt)], sample["logprobs"], strict=False)
               if m and lp < math.log(0.1))
    assert lows == want


# ---------------------------------------------------------------------- a forked session


def test_forked_tree_and_samples(tree_run: Path, tree_view: ViewProcess, page: Any,
                                 screenshots: Path) -> None:
    tree_view.open(page)
    page.goto(tree_view.url + "#/e/fix-median.0")
    page.wait_for_selector("#turns .turn")
    # Side calls are kept apart: the main line shows 3 turns, the side-call tab 1.
    assert page.eval_on_selector_all("#turns .turn", "els => els.length") == 3
    assert "history diverged" in page.inner_text("#turns")
    shot(page, screenshots, "episode-forked")
    page.click("button[data-line=side]")
    expect(page.locator("#turns .turn.side")).to_have_count(1)
    page.click("#tree-link")
    page.wait_for_selector("#tree .node")
    # Both branches: a fork at the first answer, two leaves, each naming its sample.
    assert page.eval_on_selector_all("#tree .badge.fork", "els => els.length") == 1
    assert page.eval_on_selector_all("#tree li.branch", "els => els.length") == 2
    text = page.inner_text("#tree")
    assert "sorting it fixes the bug" in text and "Running the tests: 2 failed." in text
    assert "leaf 0" in text and "leaf 1" in text and "sample 0" in text and "sample 1" in text
    shot(page, screenshots, "tree")
    # The second branch's sample: its trained tokens are its own turn's only (turn 1 was trained by sample 0).
    samples = [json.loads(line)
               for line in (tree_run / "trajectories" / "fix-median.0.jsonl").read_text().splitlines()]
    assert [s["metadata"]["branch"] for s in samples[:2]] == [0, 1]
    page.click("#tree a.badge.leaf:text-is('sample 1')")
    page.wait_for_selector("#tokens .tok")
    _check_sample_page(page, tree_view.url, "fix-median.0", 1, samples[1])
    shot(page, screenshots, "sample")


# ---------------------------------------------------------------------- what the agent printed


def _assert_inert(page: Any) -> None:
    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert page.dialogs == []
    assert page.errors == []
    assert page.eval_on_selector_all("script",
                                     "els => els.map(e => e.getAttribute('src'))") == ["/ui/static/viewer.js"]
    assert page.eval_on_selector_all("img, iframe, object, embed", "els => els.length") == 0
    assert page.eval_on_selector_all(
        "a[href]", "els => els.filter(a => !a.getAttribute('href').startsWith('#')).length") == 0
    assert "\x1b" not in page.evaluate("document.body.textContent")


def test_injections_are_text(tree_view: ViewProcess, page: Any, screenshots: Path) -> None:
    tree_view.open(page)
    rows = _rows(page)
    hostile = next(cells for key, cells in rows.items() if key.startswith("hostile"))
    assert hostile[1] == HOSTILE_TASK  # the task name, as text
    assert "<script>window.__pwned='error'</script> boom" in hostile[7]  # the error, ANSI stripped
    _assert_inert(page)
    page.click("a.ep-link:has-text('hostile')")
    expect(page.locator("#turns .turn")).to_have_count(2)
    page.wait_for_timeout(300)  # an onerror handler would have fired by now
    text = page.inner_text("#turns")
    for injection in INJECTIONS[:3]:
        assert injection in text, injection
    assert "RED ALERT done" in text  # ANSI colour and title sequences stripped, the words kept
    assert "<script>window.__pwned = 'script'</script>" in page.inner_text("#verifier")
    _assert_inert(page)
    shot(page, screenshots, "injection")
    # The tree and the sample pages show the same text inertly.
    page.click("#tree-link")
    page.wait_for_selector("#tree .node")
    assert "<img src=\"x\" onerror=" in page.inner_text("#tree")
    _assert_inert(page)


def test_headers_are_strict(tree_view: ViewProcess) -> None:
    import urllib.error
    import urllib.request

    # Closed without view's token, as serve's /ui/ is without the admin token.
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(tree_view.url + "api/run")
    assert err.value.code == 401
    bearer = {"Authorization": f"Bearer {tree_view.token}"}
    # 127.0.0.1 only
    with urllib.request.urlopen(urllib.request.Request(tree_view.url, headers=bearer)) as resp:
        csp = resp.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe-inline" not in csp
        assert resp.headers["x-content-type-options"] == "nosniff"
        page = resp.read().decode()
    assert "<script src=\"/ui/static/viewer.js\" defer></script>" in page and "<script>" not in page
    # Read-only: nothing but GET (and the login form) is served.
    req = urllib.request.Request(tree_view.url + "api/run", method="POST", data=b"{}", headers=bearer)
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req)
    assert err.value.code == 405


def test_package_ships_the_page() -> None:
    from importlib import resources

    static = resources.files("ares_gateway.viewer").joinpath("static")
    assert {p.name for p in static.iterdir()} >= {"index.html", "viewer.js", "viewer.css", "login.js"}
    text = (REPO / "pyproject.toml").read_text()
    assert '"ares_gateway.viewer" = ["static/*.html", "static/*.css", "static/*.js"]' in text
    js = (REPO / "ares_gateway" / "viewer" / "static" / "viewer.js").read_text()
    assert "innerHTML" not in js.replace("never innerHTML", "") and "insertAdjacentHTML" not in js
    assert "eval(" not in js and "document.write" not in js


def test_view_of_a_data_dir(tmp_path: Path, page: Any, screenshots: Path) -> None:
    """``view`` on a gateway data dir alone (as ``serve`` leaves one): its sessions are the episodes,
    their turns and trees read from the records."""
    run = build_run(tmp_path / "run",
                    [("fix-median", 1.0, forked_session), (HOSTILE_TASK, 0.0, injection_session)],
                    keep_sessions=True)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, run).result()
    view = ViewProcess(tmp_path / "run" / "gateway-data")
    try:
        view.open(page)
        rows = _rows(page)
        assert len(rows) == 2 and all(key.startswith("session:") for key in rows)
        forked = next(key for key, cells in rows.items() if cells[1] == "fix-median")
        page.click(f"a.ep-link:text-is('{forked}')")
        expect(page.locator("#turns .turn")).to_have_count(3)
        page.click("#tree-link")
        expect(page.locator("#tree li.branch")).to_have_count(2)
        _assert_inert(page)
    finally:
        view.stop()
