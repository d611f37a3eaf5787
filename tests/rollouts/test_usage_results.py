"""Per-call usage and timing summed per episode and run, on real episodes: tiny-agent in local sandboxes,
every call answered in process by the oracle policy with token records. The sums in episodes.jsonl and
results.json equal what the turn logs' token records give (prompt and output ids, the prefix each prompt
shares with the previous turn's prompt + output); the timings are present, non-negative and ordered; the
run's totals are the episodes' sums; TensorBoard has each episode's sums; the viewer's episode page data
carries the episode's sums and each turn's usage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing import event_accumulator

from ares_gateway import EpisodeConfig, RolloutSource, RunConfig
from ares_gateway.episodes.tasks import load_dataset
from ares_gateway.episodes.usage import USAGE_FIELDS
from ares_gateway.viewer.source import RunSource
from tests.rollouts.test_stream import TokenOracle

TASKS = load_dataset("examples").tasks


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _from_records(turns: list[dict[str, Any]]) -> tuple[int, int, int]:
    """Prompt, output and reused prompt tokens as the turn log's token records spell them."""
    prompt = output = reused = 0
    prev: list[int] | None = None
    for t in turns:
        rec = t["completion"]["tokens"]
        prompt += len(rec["prompt_ids"])
        output += len(rec["output_ids"])
        reused += 0 if prev is None else _common(prev, rec["prompt_ids"])
        prev = rec["prompt_ids"] + rec["output_ids"]
    return prompt, output, reused


@pytest.mark.asyncio
async def test_episode_and_run_usage_equal_the_token_records(tmp_path: Path, sandbox_root: Path) -> None:
    out = tmp_path / "run"
    source = RolloutSource(
        TASKS[:2], policy=TokenOracle(delay=0.05), episode=EpisodeConfig("tiny-agent", sandbox="local"),
        run=RunConfig(concurrency=2, attempts=1, out=out, stats="tensorboard", stats_period=0),
    )
    groups = [g async for g in source.groups()]
    assert len(groups) == 2
    await source.close()
    doc = json.loads((out / "results.json").read_text())
    lines = [json.loads(x) for x in (out / "episodes.jsonl").read_text().splitlines()]
    assert sorted(e["key"] if "key" in e else f"{e['task']}.{e['attempt']}" for e in lines) == sorted(
        f"{e['task']}.{e['attempt']}" for e in doc["episodes"])
    totals: dict[str, float] = dict.fromkeys(USAGE_FIELDS, 0.0)
    for e in doc["episodes"]:
        turns = [json.loads(x)
                 for x in (out / "turns" / f"{e['task']}.{e['attempt']}.jsonl").read_text().splitlines()]
        assert len(turns) >= 2, "tiny-agent takes more than one turn on the oracle's answers"
        use = e["usage"]
        assert (use["prompt_tokens"], use["completion_tokens"],
                use["reused_prompt_tokens"]) == _from_records(turns)
        assert use["reused_prompt_tokens"] > 0  # each prompt continues the last
        assert use["ttft_seconds"] is None  # tiny-agent does not stream
        for t in turns:  # each turn's timing: present, non-negative, adding up to its latency
            u = t["usage"]
            assert u["parked_seconds"] >= 0 and u["policy_seconds"] >= 0.05 * 0.9, u
            assert u["parked_seconds"] <= t["latency"] and u["policy_seconds"] <= t["latency"] + 1e-6
            assert abs(u["parked_seconds"] + u["policy_seconds"] - t["latency"]) < 1e-3
        assert [t["usage"]["think_seconds"] is None for t in turns] == [True] + [False] * (len(turns) - 1)
        assert all(t["usage"]["think_seconds"] >= 0 for t in turns[1:])
        assert abs(use["policy_seconds"] - sum(t["usage"]["policy_seconds"] for t in turns)) < 1e-4
        # The agent's whole time covers its calls and its thinking between them.
        assert use["parked_seconds"] + use["policy_seconds"] + use["think_seconds"] <= e[
            "agent_seconds"] + 0.05
        view = RunSource(out)
        key = f"{e['task']}.{e['attempt']}"
        assert view.episode(key)["episode"]["usage"] == use
        assert [t["usage"] for t in view.turns(key)["turns"]] == [t["usage"] for t in turns]
        view.close()
        line = next(x for x in lines if (x["task"], x["attempt"]) == (e["task"], e["attempt"]))
        assert line["usage"] == use
        for k in USAGE_FIELDS:
            if use[k] is not None:
                totals[k] += use[k]
    run = doc["summary"]["usage"]
    for k in ("prompt_tokens", "completion_tokens", "reused_prompt_tokens"):
        assert run[k] == totals[k]
    assert run["ttft_seconds"] is None
    assert abs(run["policy_seconds"] - totals["policy_seconds"]) < 1e-4
    acc = event_accumulator.EventAccumulator(str(out / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "usage/ttft_seconds" not in tags  # not known: not logged, never 0
    prompts = sorted(ev.value for ev in acc.Scalars("usage/prompt_tokens"))
    assert prompts == sorted(float(e["usage"]["prompt_tokens"]) for e in doc["episodes"])
    assert len(acc.Scalars("usage/parked_seconds")) == 2
