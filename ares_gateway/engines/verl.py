"""verl's rollout servers as an engine, through the agent loop's ``server_manager``.

Inside verl's agent loop (:mod:`ares_gateway.trainers.verl`) the model is reached through the
worker's ``LLMServerClient``, token-in/token-out::

    await server_manager.generate(request_id, prompt_ids=[...], sampling_params={...}) -> TokenOutput
    TokenOutput(token_ids=[...], log_probs=[...] | None, stop_reason="completed" | "aborted" | ...)

``request_id`` is sticky: verl's load balancer sends one id to one server, whose prefix cache then
holds that conversation. The engine passes the gateway session it samples for
(:data:`~ares_gateway.engines.base.request_session`), so every turn of an episode goes to the
server that holds its history. ``sampling_params`` is what verl's vLLM and SGLang servers take:
``temperature`` (0: greedy), ``top_p``, ``top_k`` (-1: off), ``max_tokens``, ``stop_token_ids``,
``logprobs`` (a flag: the servers return one logprob per sampled token only when it is true), plus
the worker's own keys (``repetition_penalty``) passed through as given.

verl does not stream: :meth:`VerlEngine.stream` yields the whole answer as one chunk.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from ares_gateway.engines.base import (
    EngineResponseError,
    EngineUnavailableError,
    FinishReason,
    GenerateResult,
    Sampling,
    TokenChunk,
    request_session,
)

__all__ = ["VerlEngine"]

#: Keys :class:`Sampling` sets; the worker's other sampling keys pass through unchanged.
_OWN_KEYS = frozenset(
    {"temperature", "top_p", "top_k", "max_tokens", "max_new_tokens", "stop_token_ids", "logprobs",
     "seed"})


class VerlEngine:
    """Samples through a verl ``LLMServerClient`` (the agent loop's ``self.server_manager``).

    Args:
        server_manager: the worker's client; anything with verl's ``async generate(request_id, *,
            prompt_ids, sampling_params) -> TokenOutput``.
        model: the model's name or path, recorded per run (verl's ``actor_rollout_ref.model.path``).
        sampling_params: the worker's sampling parameters for this rollout (what verl passes to
            ``AgentLoopBase.run``); keys :class:`Sampling` does not set (``repetition_penalty``) are
            sent as given.
    """

    name = "verl"

    def __init__(self, server_manager: Any, *, model: str = "",
                 sampling_params: Mapping[str, Any] | None = None) -> None:
        self.server_manager = server_manager
        self.model = model
        self._passthrough = {k: v for k, v in dict(sampling_params or {}).items() if k not in _OWN_KEYS}
        #: Calls made, and seconds spent waiting on the servers (the trainer's generation time).
        self.calls = 0
        self.busy_s = 0.0

    def sampling_params(self, sampling: Sampling) -> dict[str, Any]:
        """The ``sampling_params`` dict verl's servers get for ``sampling``."""
        params: dict[str, Any] = {
            **self._passthrough,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,
            "max_tokens": sampling.max_tokens,
            "logprobs": True,
        }
        if sampling.stop_token_ids:
            params["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.seed is not None:
            params["seed"] = sampling.seed
        return params

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling) -> GenerateResult:
        """One answer from verl's servers; the request id is the session being sampled."""
        request_id = request_session.get() or f"ares-{uuid.uuid4().hex}"
        t0 = time.perf_counter()
        try:
            out = await self.server_manager.generate(
                request_id, prompt_ids=list(prompt_ids), sampling_params=self.sampling_params(sampling)
            )
        except Exception as exc:
            raise EngineUnavailableError(
                f"verl's server_manager.generate failed: {type(exc).__name__}: {exc}") from exc
        finally:
            seconds = time.perf_counter() - t0
            self.calls += 1
            self.busy_s += seconds
        return self._result(out, len(prompt_ids), sampling, seconds)

    async def stream(self, prompt_ids: Sequence[int],
                     sampling: Sampling) -> AsyncIterator[TokenChunk | GenerateResult]:
        """The whole answer as one chunk, then the result (verl's servers answer whole)."""
        result = await self.generate(prompt_ids, sampling)
        yield TokenChunk(ids=list(result.output_ids), logprobs=list(result.logprobs))
        yield result

    async def aclose(self) -> None:
        """Nothing to release: the servers are verl's."""

    def _result(self, out: Any, prompt_tokens: int, sampling: Sampling, seconds: float) -> GenerateResult:
        ids = getattr(out, "token_ids", None)
        if ids is None:
            raise EngineResponseError(
                f"verl's server_manager.generate returned {type(out).__name__}, not a TokenOutput")
        stop_reason = getattr(out, "stop_reason", None)
        if stop_reason == "aborted":
            raise EngineUnavailableError(
                "verl aborted the request (its servers were paused for a weight update)")
        ids = [int(t) for t in ids]
        logprobs = getattr(out, "log_probs", None)
        if logprobs is None and ids:
            raise EngineResponseError(
                "verl's server returned no log_probs: the samples need them; the engine asks with "
                "logprobs=True, so check that the rollout server honours it "
                "(actor_rollout_ref.rollout.calculate_log_probs=True)"
            )
        logprobs = [float(x) for x in (logprobs or [])]
        stopped = bool(ids) and ids[-1] in sampling.stop_token_ids
        finish: FinishReason = "length" if len(ids) >= sampling.max_tokens and not stopped else "stop"
        extra: dict[str, Any] = {}
        fields = getattr(out, "extra_fields", None) or {}
        cached = fields.get("num_cached_tokens") if isinstance(fields, Mapping) else None
        if isinstance(fields, Mapping) and fields.get("global_steps") is not None:
            extra["global_steps"] = fields["global_steps"]
        return GenerateResult(output_ids=ids, logprobs=logprobs, finish_reason=finish,
                              prompt_tokens=prompt_tokens, cached_tokens=int(cached or 0), decode_s=seconds,
                              extra=extra)
