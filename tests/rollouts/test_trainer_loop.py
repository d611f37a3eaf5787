"""examples/trainer_loop.py runs as a user would run it: parallel GatewayEnv episodes with the real
mini-swe-agent in local sandboxes, token-recorded answers, samples collected, nothing left behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .e2e import REPO, require_mini
from .test_env_and_runner import left_behind


@pytest.mark.slow
def test_trainer_loop_example_collects_samples(tmp_path: Path) -> None:
    require_mini("local")
    boxes = tmp_path / "sandboxes"
    proc = subprocess.run(
        [sys.executable, "examples/trainer_loop.py", "--sandbox", "local", "--episodes", "3", "--concurrency",
         "3"],
        cwd=REPO, env={**os.environ, "ARES_SANDBOX_LOCAL_ROOT": str(boxes)},
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    match = re.search(
        r"iteration 0: 3 episodes, mean reward ([\d.]+), (\d+) samples, (\d+) tokens \((\d+) trained\)",
        proc.stdout)
    assert match, proc.stdout
    reward, samples, tokens, trained = float(match[1]), int(match[2]), int(match[3]), int(match[4])
    assert reward == 1.0 and samples >= 3 and 0 < trained < tokens
    assert left_behind(boxes) == []
