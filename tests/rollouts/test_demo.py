"""``ares-gateway demo`` (the README's main job) on this machine: the bundled examples with the real
mini-swe-agent in local sandboxes and the oracle policy; no API key, Docker or GPU used."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from .e2e import REPO, cli, require_mini
from .test_env_and_runner import left_behind


@pytest.mark.slow
def test_demo(tmp_path: Path) -> None:
    require_mini("local")
    out, boxes = tmp_path / "demo", tmp_path / "sandboxes"
    env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
    env.update(ARES_SANDBOX_LOCAL_ROOT=str(boxes), DOCKER_HOST="unix:///nonexistent.sock")  # no Docker needed
    proc = subprocess.run(cli("demo", "--out", str(out)), cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    assert "mean reward: 1.000" in text and "pass@1: 1.000" in text
    for line in ("fix-median-bug", "write-greeting-file", f"Trajectories: {out / 'trajectories'}",
                 f"tensorboard --logdir {out / 'tb'}",
                 "ares-gateway run examples-mswea --policy upstream --base-url http://127.0.0.1:8000/v1"):
        assert line in text, line
    doc = json.loads((out / "results.json").read_text())
    assert doc["run"]["sandbox"] == "local" and doc["run"]["policy"] == "oracle"
    assert [e["reward"] for e in doc["episodes"]] == [1.0] * 4
    assert list((out / "tb").glob("events.out.tfevents.*"))
    assert left_behind(boxes) == []
