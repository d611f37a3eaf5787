"""How fast the trajectory viewer opens a large run: 1,000 episodes, a 200-turn Claude-Code-sized session
(the request growing to ~600 KB, ~60 MB of turn log) and its 157k-token sample.

    PYTHONPATH=. python3 bench/bench_viewer.py [--repeat 5] [--no-browser]

Serves the run with the viewer's own server on 127.0.0.1 and prints, for each API call a page makes,
the first (cold: files read and turn views built) and the median warm time, and the bytes sent; then,
with Debian's Chromium (``.ci/provision-browser.sh``), the time from navigation to the page drawn.
The data is the scale test's (``bench/support/viewer_runs.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from ares_gateway.viewer import RunSource, Viewer, serve_viewer
from bench.support.viewer_runs import big_run, big_sample, big_session

KEY = "big-task.0"
TREE_KEY = "big-tree.0"
CALLS = [
    ("run table, first page", "api/run?limit=50"),
    ("run table, sorted by reward, filtered", "api/run?limit=50&sort=reward&exit=agent_error"),
    ("200-turn episode", f"api/episode?key={KEY}"),
    ("its first 50 turns", f"api/turns?key={KEY}&limit=50"),
    ("its turns 150-199", f"api/turns?key={KEY}&offset=150&limit=50"),
    ("157k-token sample, a 2,000-token window", f"api/sample?key={KEY}&index=0&offset=97000&limit=2000"),
    ("message tree of a 200-turn log (token records)", f"api/tree?key={TREE_KEY}"),
]


async def _api(url: str, repeat: int) -> list[tuple[str, float, float, int]]:
    out = []
    async with aiohttp.ClientSession() as http:
        for label, path in CALLS:
            times, size = [], 0
            for _ in range(repeat + 1):
                t0 = time.perf_counter()
                async with http.get(url + path) as resp:
                    body = await resp.read()
                    assert resp.status == 200, (path, resp.status)
                times.append(time.perf_counter() - t0)
                size = len(body)
            out.append((label, times[0], statistics.median(times[1:]), size))
    return out


def _browser(url: str) -> list[tuple[str, float]]:
    from playwright.sync_api import sync_playwright

    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync"]
    out = []
    profile = tempfile.mkdtemp(prefix="bench-viewer-chromium-")
    try:
        with sync_playwright() as pw:
            ctx = pw.chromium.launch_persistent_context(profile, executable_path="/usr/bin/chromium",
                                                        headless=True,
                                                        args=flags)
            page = ctx.new_page()
            for label, target, selector, count in [
                ("run page (1,000 episodes)", url, "#episodes tbody tr", 50),
                ("episode page (200 turns)", url + f"#/e/{KEY}", "#turns .turn", 50),
                ("sample page (157k tokens)", url + f"#/e/{KEY}/s/0@97000", "#tokens .tok", 2000),
            ]:
                page.goto("about:blank")
                t0 = time.perf_counter()
                page.goto(target)
                page.locator(selector).nth(count - 1).wait_for()
                out.append((label, time.perf_counter() - t0))
            ctx.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    return out


async def _serve(run: Path, repeat: int, browser: bool) -> None:
    source = RunSource(run)
    viewer = Viewer(source)
    runner, port = await serve_viewer(viewer, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}/ui/"
    try:
        print(f"{'API call':<48} {'cold ms':>8} {'warm ms':>8} {'bytes':>9}")
        for label, cold, warm, size in await _api(url, repeat):
            print(f"{label:<48} {cold * 1000:>8.1f} {warm * 1000:>8.1f} {size:>9,}")
        if browser:
            source._turns.clear()  # the first open of the episode in the browser is a cold one
            source._samples.clear()
            print(f"\n{'in Chromium: navigation to drawn':<48} {'ms':>8}")
            for label, took in await asyncio.to_thread(_browser, url):
                print(f"{label:<48} {took * 1000:>8.1f}")
    finally:
        viewer.close()
        await runner.cleanup()
        source.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5, help="warm repetitions per call (median)")
    ap.add_argument("--no-browser", action="store_true", help="API timings only")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-viewer-"))
    try:
        run = tmp / "run"
        run.mkdir()
        t0 = time.perf_counter()
        big_run(run, 1000)
        big_session(run, KEY, turns=200, turn_kb=600)
        big_session(run, TREE_KEY, turns=200, turn_kb=600, tokens=True)
        big_sample(run, KEY)
        size = sum(p.stat().st_size for p in run.rglob("*") if p.is_file())
        print(f"run directory: 1,000 episodes + two 200-turn sessions, {size / 2**20:.0f} MiB, "
              f"built in {time.perf_counter() - t0:.1f} s\n")
        asyncio.run(_serve(run, args.repeat, not args.no_browser))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
