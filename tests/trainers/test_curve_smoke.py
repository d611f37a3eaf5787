"""bench/bench_learning_curve.py end to end at its smallest (one seed, one GRPO step of two real
mini-swe-agent episodes sampled by SmolLM2 through the gateway), and the format reward's rule."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ares_gateway.trainers.rewards import FormatRule
from harnesses.mini_swe_agent import LENIENT_ACTION_REGEX
from tests.prereq import require

ROOT = Path(__file__).resolve().parents[2]


def test_the_format_rule_is_mini_swe_agents() -> None:
    """mini's text mode takes an answer with exactly one action block; none or two is a format error."""
    rule = FormatRule.mini_swe_agent_text(LENIENT_ACTION_REGEX)
    assert rule.parses("THOUGHT: make it\n\n```bash\ntouch done.txt\n```")
    assert rule.parses("```mswea_bash_command\nls\n```")
    assert not rule.parses("I would run touch done.txt")
    assert not rule.parses("```bash\nls\n```\nthen\n```bash\npwd\n```")
    assert not FormatRule.mini_swe_agent_text().parses("```bash\nls\n```")  # mini's own regex: its tag only


def test_the_goal_check_needs_the_bands_apart() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_learning_curve import summarize

    def run(fmt: list[float], task: list[float]) -> dict[str, object]:
        return {"steps": [{"format": f, "task": t} for f, t in zip(fmt, task, strict=True)]}

    rising = [run([0.1, 0.2, 0.5, 0.8, 0.9], [0, 0, 0, 0.5, 0.5]),
              run([0.0, 0.3, 0.6, 0.7, 1.0], [0, 0, 0, 0, 0])]
    g = summarize(rising)["goal"]
    assert g["format_rose"] and g["task_not_lower"] and g["met"]
    flat = [run([0.1, 0.2, 0.5, 0.8, 0.2], [0] * 5), run([0.6, 0.3, 0.6, 0.7, 0.5], [0] * 5)]
    assert summarize(flat)["goal"]["format_rose"] is False
    assert summarize(rising[:1])["goal"]["format_rose"] is None  # one seed has no spread


@pytest.mark.slow
def test_the_curve_runs_a_step_and_writes_its_outputs(tmp_path: Path) -> None:
    from ares_gateway.episodes.installs import install_root

    require(install_root("mini-swe-agent") is not None,
            "mini-swe-agent is not installed for local sandboxes: bash .ci/provision-agents.sh")
    out = tmp_path / "curve"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_learning_curve.py"), "--seeds", "0", "--steps", "1",
         "--num-generations", "2", "--step-limit", "1", "--max-tokens", "8", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TRL_EXPERIMENTAL_SILENCE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("goal: format rose beyond the seeds' spread: not checkable with one seed"
            in proc.stdout), proc.stdout
    report = json.loads((out / "curve.json").read_text())
    (step,) = report["runs"][0]["steps"]
    assert step["episodes"] == 2 and step["failed"] == 0, step
    assert 0 <= step["parsed"] <= step["calls"] and step["calls"] >= 2  # each episode made its one call
    assert 0.0 <= step["format"] <= 1.0 and step["task"] in (0.0, 0.5, 1.0)
    assert report["curve"][0]["format"]["mean"] == step["format"] and report["wall_s"] > 0
    assert (out / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    assert {"curve/format_mean", "curve/task_mean", "seed0/format"} <= set(acc.Tags()["scalars"])
    assert acc.Scalars("curve/format_mean")[0].value == pytest.approx(step["format"])
