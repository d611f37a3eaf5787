"""The viewer at scale: a run of 1,000 episodes and a 200-turn Claude-Code-sized session (~600 KB a
request at the end, ~60 MB of turn log) are sent a page at a time, never whole; the browser shows the
first page of each. Timings are bench/bench_viewer.py's (docs/performance.md), not asserted here."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from ares_gateway.viewer import RunSource
from bench.support.viewer_runs import big_run, big_sample, big_session

from .conftest import ViewProcess, expect, shot

KEY = "big-task.0"


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("big") / "run"
    out.mkdir()
    big_run(out, 1000)
    big_session(out, KEY, turns=200, turn_kb=600)
    big_sample(out, KEY)
    return out


@pytest.fixture(scope="module")
def big_view(big: Path) -> Iterator[ViewProcess]:
    view = ViewProcess(big)
    yield view
    view.stop()


def _size(data: Any) -> int:
    return len(orjson.dumps(data, default=str))


def test_pages_are_small(big: Path) -> None:
    log = big / "turns" / f"{KEY}.jsonl"
    last = json.loads(log.read_text().splitlines()[-1])
    assert len(json.dumps(last["request"])) > 550_000  # the last request is Claude-Code-sized
    source = RunSource(big)
    run = source.run_page()
    assert run["total"] == 1001 and len(run["rows"]) == 50
    assert _size(run) < 40_000
    # Sorted and filtered on the server: the page gets 50 rows of the ones that match.
    worst = source.run_page(sort="reward", desc=False, exit_reason="agent_error")
    assert worst["matched"] == 112 and all(r["exit_reason"] == "agent_error" for r in worst["rows"])
    episode = source.episode(KEY)
    assert episode["turns"] == 200 and _size(episode) < 20_000
    first = source.turns(KEY, limit=50)
    assert first["total"] == 200 and len(first["turns"]) == 50
    assert _size(first) < 400_000 < log.stat().st_size // 100  # new messages only, texts cut
    sample = source.sample(KEY, 0, limit=2000)
    assert sample["total"] == 157_000 and len(sample["tokens"]) == 2000 and _size(sample) < 80_000
    assert sample["trained"] == 30_000
    source.close()


def test_browser_opens_the_big_pages(big_view: ViewProcess, page: Any, screenshots: Path) -> None:
    big_view.open(page)
    expect(page.locator("#episodes tbody tr")).to_have_count(50)
    assert "1\u201350 of 1001" in page.inner_text("#page-info")
    page.click("#episodes th.col-reward")
    expect(page.locator("#episodes th.col-reward.sorted")).to_have_count(1)
    page.select_option("#exit-filter", "agent_error")
    expect(page.locator("#page-info")).to_have_text("1\u201350 of 112 (of 1001)")
    shot(page, screenshots, "run-big")
    page.goto(big_view.url + f"#/e/{KEY}")
    expect(page.locator("#turns .turn")).to_have_count(50)
    page.click("#more-turns")
    expect(page.locator("#turns .turn")).to_have_count(100)
    shot(page, screenshots, "episode-big")
    page.goto(big_view.url + f"#/e/{KEY}/s/0@97000")
    expect(page.locator("#tokens .tok")).to_have_count(2000)
    assert page.inner_text("#trained-count") == "30000"
    shot(page, screenshots, "sample-big")
