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


@pytest.fixture(scope="module")
def smollm2() -> tuple[Any, Any]:
    return load_smollm2()
