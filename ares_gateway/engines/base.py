"""The engine protocol: token ids in, sampled token ids (with their logprobs) out.

An engine is a "dumb" sampler. The gateway renders the prompt (:mod:`ares_gateway.tokens`), the
engine samples, and the gateway parses the sampled ids back into text and tool calls.

* :class:`Sampling` — how to sample one turn (recorded per turn: temperature, top_p, top_k, seed).
* :class:`GenerateResult` — output ids, one logprob per output id, finish reason, timings.
* :class:`Engine` — ``await engine.generate(prompt_ids, sampling)``; ``engine.stream(...)`` yields
  :class:`TokenChunk` pieces and ends with the :class:`GenerateResult`.

**Logprobs, stated exactly.** The logprob recorded for a sampled token is its log-probability
under the distribution it was sampled from (after temperature / top-k / top-p; the engine's own
numbers, never a recomputation under another batching). At temperature 1.0 with no top-k/top-p
that is the model's log-softmax.

Errors (one hierarchy)::

    EngineError                    base class
    ├── EngineUnavailableError     the engine cannot be reached / keeps failing (after retries)
    ├── EngineResponseError        the engine answered something that breaks its documented schema
    └── PromptTooLongError         prompt + requested tokens do not fit the engine's context
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

__all__ = [
    "Engine",
    "EngineError",
    "EngineResponseError",
    "EngineUnavailableError",
    "GenerateResult",
    "PromptTooLongError",
    "Sampling",
    "TokenChunk",
    "collect",
    "request_session",
]

#: The gateway session whose request is being sampled, set by the policy before it calls the engine
#: (the episode's own task: a value per concurrent episode). Engines that route by session read it:
#: verl's server manager sends one request id to one server, whose prefix cache holds its history.
request_session: ContextVar[str | None] = ContextVar("ares_request_session", default=None)

FinishReason = Literal["stop", "length"]


class EngineError(Exception):
    """Base class of engine failures."""


class EngineUnavailableError(EngineError):
    """The engine could not be reached or kept failing; check that it runs at the configured URL."""


class EngineResponseError(EngineError):
    """The engine's answer does not follow its documented schema (or lacks ids/logprobs)."""


class PromptTooLongError(EngineError):
    """The prompt (plus at least one output token) does not fit the engine's context window."""

    def __init__(self, prompt_tokens: int, context: int) -> None:
        super().__init__(
            f"the prompt has {prompt_tokens} tokens but the engine's context holds {context}; "
            "shorten the conversation (or use a model with a longer context)"
        )
        self.prompt_tokens = prompt_tokens
        self.context = context


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters of one generation.

    ``top_k=0`` and ``top_p=1.0`` mean off; ``temperature=0`` means greedy (logprobs are then those
    of the model's log-softmax at temperature 1, the distribution the argmax was taken over).
    ``seed`` makes the in-process engine reproducible (HTTP engines pass it on).
    ``stop_token_ids`` end the generation (the stop token is kept in the output, as sampled).
    """

    max_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):  # NaN fails every comparison
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")

    def to_record(self) -> dict[str, Any]:
        """What the turn log records: temperature, top_p, top_k, seed, max_tokens."""
        d = asdict(self)
        d.pop("stop_token_ids")
        return d


@dataclass
class TokenChunk:
    """Some newly sampled tokens, streamed: ids and their logprobs."""

    ids: list[int]
    logprobs: list[float]


@dataclass
class GenerateResult:
    """One generation as the engine produced it."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    prompt_tokens: int = 0
    #: Prompt tokens the engine reused from its cache (not evaluated again), when it says.
    cached_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    #: The version of the weights that sampled it, where the engine reports one (SGLang's
    #: ``meta_info.weight_version`` when it is a decimal integer; an in-process engine's label, as set
    #: when the generation started: ``set_weight_version``); ``None``: it does not say.
    weight_version: int | None = None

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.output_ids):
            raise EngineResponseError(
                f"{len(self.output_ids)} output ids but {len(self.logprobs)} logprobs: an engine must give "
                "one per token"
            )


@runtime_checkable
class Engine(Protocol):
    """Samples continuations of token-id prompts. Implementations: ``llama_cpp``, ``sglang``, ``vllm``."""

    #: Short backend name (``"llama-cpp"``, ``"sglang"``, ``"vllm"``), recorded per run.
    name: str
    #: The model path or name, recorded per run.
    model: str

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling) -> GenerateResult:
        """Sample one continuation of ``prompt_ids``."""
        ...

    def stream(self, prompt_ids: Sequence[int],
               sampling: Sampling) -> AsyncIterator[TokenChunk | GenerateResult]:
        """Like :meth:`generate`, yielding :class:`TokenChunk` pieces as sampled, then the result."""
        ...

    async def aclose(self) -> None:
        """Release the engine (model memory, HTTP connections)."""
        ...


async def collect(chunks: AsyncIterator[TokenChunk | GenerateResult]) -> GenerateResult:
    """Drain a :meth:`Engine.stream` to its :class:`GenerateResult`."""
    result: GenerateResult | None = None
    async for item in chunks:
        if isinstance(item, GenerateResult):
            result = item
    if result is None:
        raise EngineResponseError("the engine's stream ended without a result")
    return result
