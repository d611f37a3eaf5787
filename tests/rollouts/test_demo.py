"""``ares-gateway demo`` (the README's main job) on this machine, as a subprocess: the bundled examples
with the real mini-swe-agent in local sandboxes, first the oracle policy (every task solved), then the
embedded SmolLM2-135M on in-process llama.cpp (tito policy), whose turns must be written as real
training samples. No API key, Docker or GPU used. Missing llama_cpp skips (fails under ``ARES_CI=1``)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import cli
from tests.tito.conftest import need_llama

from .e2e import REPO, require_mini
from .test_env_and_runner import left_behind


def _env(boxes: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
    env.update(ARES_SANDBOX_LOCAL_ROOT=str(boxes), DOCKER_HOST="unix:///nonexistent.sock")  # no Docker needed
    return env


@pytest.mark.slow
def test_demo(tmp_path: Path) -> None:
    require_mini("local")
    need_llama()
    out, boxes = tmp_path / "demo", tmp_path / "sandboxes"
    t0 = time.monotonic()
    proc = subprocess.run(cli("demo", "--out", str(out)), cwd=REPO, env=_env(boxes), capture_output=True,
                          text=True, timeout=400, check=False)
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    # 1. the oracle solves every task
    assert "mean reward: 1.000" in text and "pass@1: 1.000" in text
    doc = json.loads((out / "oracle" / "results.json").read_text())
    assert doc["run"]["sandbox"] == "local" and doc["run"]["policy"] == "oracle"
    assert [e["reward"] for e in doc["episodes"]] == [1.0] * 4
    # 2. the real model writes real samples, and the demo says where
    for line in ("fix-median-bug", "write-greeting-file",
                 f"Training samples: {out / 'model' / 'trajectories'}",
                 f"tensorboard --logdir {out}", "--policy tito --engine llama-cpp", "main-line drift 0"):
        assert line in text, line
    run = json.loads((out / "model" / "results.json").read_text())
    assert run["run"]["policy"] == "tito" and run["run"]["engine"] == "llama-cpp"
    assert run["run"]["model"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert {k: run["run"]["sampling"][k] for k in ("temperature", "top_p", "top_k")} == \
        {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
    assert run["episodes"] and all(e["fidelity"]["main_line_drift"] == 0 for e in run["episodes"])
    samples = [json.loads(line) for f in sorted((out / "model" / "trajectories").glob("*.jsonl"))
               for line in f.read_text().splitlines()]
    assert samples, "the demo wrote no training sample"
    assert sum(e["fidelity"]["trained_tokens"] for e in run["episodes"]) == sum(sum(s["loss_mask"])
                                                                                for s in samples)
    for s in samples:
        assert {"tokens", "loss_mask", "logprobs", "response_length", "metadata"} <= set(s)
        assert 0 < s["response_length"] == len(s["loss_mask"]) == len(s["logprobs"]) < len(s["tokens"])
        lp = np.array(s["logprobs"])[np.array(s["loss_mask"]) == 1]
        assert lp.size and np.all(lp <= 0) and np.all(np.isfinite(lp))
        assert s["metadata"]["session_id"]
    # Every turn's log entry carries its token record and sampling parameters (with the drawn seed).
    turns = [json.loads(line) for f in (out / "model" / "turns").glob("*.jsonl")
             for line in f.read_text().splitlines()]
    assert turns and all(isinstance(t["completion"]["extra"]["tito"]["sampling"]["seed"], int) for t in turns)
    assert list((out / "oracle" / "tb").glob("events.out.tfevents.*"))
    assert left_behind(boxes) == []
    print(f"demo took {took:.1f} s")  # the README states the measured time (goal: <= 3 min)


@pytest.mark.slow
def test_demo_without_llama_cpp_names_the_install_command(tmp_path: Path) -> None:
    # llama_cpp that fails to import (as on a machine without the model extra's build): the demo says
    # which command installs it, still runs the oracle part, and fails because no sample was written.
    require_mini("local")
    shim = tmp_path / "shim" / "llama_cpp"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('No module named llama_cpp (test shim)')\n")
    env = _env(tmp_path / "sandboxes")
    env["PYTHONPATH"] = os.pathsep.join([str(shim.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(cli("demo", "--out", str(tmp_path / "demo")), cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    text = " ".join(proc.stdout.split())  # the console may wrap the long command
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "mean reward: 1.000" in text
    assert (
        'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" python3 -m pip install '
        "--no-cache-dir 'llama-cpp-python>=0.3'") in text
    assert "no training samples were written" in text
    assert not (tmp_path / "demo" / "model").exists()
