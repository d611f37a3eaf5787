"""Fixtures of the trainer tests: SmolLM2-135M-Instruct's real weights as a trainable transformers model."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.prereq import require


def _need(module: str, extra: str) -> None:
    try:
        __import__(module)
    except Exception as exc:
        require(False, f"{module} is not installed ({exc}): python3 -m pip install -e '.[{extra}]'")


def load_smollm2() -> tuple[Any, Any]:
    """The embedded SmolLM2 GGUF dequantized into a float32 transformers model, and its tokenizer."""
    _need("torch", "trl")
    _need("transformers", "trl")
    _need("gguf", "trl")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ares_gateway.tokens.tokenizer import TokenizerLoadError, default_model_path

    try:
        path = default_model_path()
    except TokenizerLoadError as exc:
        require(False, str(exc))
    folder, name = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # Loaded from a quantized file: transformers marks it quantized and refuses to train it otherwise.
    model.is_quantized = False
    model.hf_quantizer = None
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model, tokenizer


def require_mini_install() -> None:
    """mini-swe-agent installed where local sandboxes find agent installs."""
    from ares_gateway.episodes.installs import install_root

    require(install_root("mini-swe-agent") is not None,
            "mini-swe-agent is not installed for local sandboxes: bash .ci/provision-agents.sh")


@pytest.fixture
def quiet_trl(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRL's warnings about its experimental modules, off."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")


@pytest.fixture(scope="module")
def smollm2() -> tuple[Any, Any]:
    return load_smollm2()


def recorded_main_line(out: Any, session_id: str) -> dict[str, Any]:
    """The episode's main-line sample as the gateway wrote it under ``out`` (trajectories/, see
    docs/recording.md), as a dict (``tokens``, ``response_length``, ``loss_mask``, ``logprobs``,
    ``metadata``)."""
    import json
    from pathlib import Path

    import numpy as np

    from ares_gateway.trainers import main_sample
    from trajectory import Sample

    samples = []
    for f in Path(out).rglob("*.jsonl"):
        if f.parent.name != "trajectories":
            continue
        for line in f.read_text().splitlines():
            d = json.loads(line)
            if d["metadata"].get("session_id") != session_id:
                continue
            samples.append(
                Sample(tokens=np.array(d["tokens"], dtype=np.int32), response_length=d["response_length"],
                       loss_mask=np.array(d["loss_mask"], dtype=np.int32),
                       logprobs=np.array(d["logprobs"], dtype=np.float32), metadata=d["metadata"]))
    assert samples, f"no recorded sample of {session_id} under {out}"
    best, _ = main_sample(samples)
    assert best is not None
    return best.to_dict()
