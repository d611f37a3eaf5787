"""SkyRL's inference engines as an engine, through its ``InferenceEngineInterface`` client.

Inside a SkyRL generator (:mod:`ares_gateway.trainers.skyrl`) the model is reached through the
trainer's ``inference_engine_client``, token-in/token-out::

    await client.generate({"prompt_token_ids": [[...]], "sampling_params": {...}, "session_ids": [sid], ...})
    -> {"response_ids": [[...]], "response_logprobs": [[...]] | None, "stop_reasons": ["stop" | "length" |
    ...], ...}

``session_ids`` route a conversation to one engine, whose prefix cache then holds it: the engine
passes the gateway session it samples for (:data:`~ares_gateway.engines.base.request_session`), so
every turn of an episode goes to the same inference engine. ``sampling_params`` is vLLM's dict as
SkyRL builds it (``get_vllm_sampling_params``): ``temperature``, ``top_p``, ``top_k`` (-1: off),
``max_tokens``, ``logprobs`` (the number of logprobs per token: 0 gives the sampled token's own),
``stop_token_ids``; the trainer's other keys (``min_p``, ``repetition_penalty``) pass through as given.

SkyRL's client does not stream here: :meth:`SkyRLEngine.stream` yields the whole answer as one chunk.
"""

from __future__ import annotations

import logging
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

log = logging.getLogger(__name__)

__all__ = ["SkyRLEngine"]

#: Keys :class:`Sampling` sets; the trainer's other sampling keys pass through unchanged. ``stop``
#: (strings) is dropped: the gateway stops on the model's stop tokens and parses the text itself.
_OWN_KEYS = frozenset({"temperature", "top_p", "top_k", "max_tokens", "max_generate_length", "stop_token_ids",
                       "logprobs", "seed", "stop"})


class SkyRLEngine:
    """Samples through a SkyRL ``InferenceEngineInterface`` (the trainer's ``inference_engine_client``).

    Args:
        client: anything with SkyRL's ``async generate(InferenceEngineInput) -> InferenceEngineOutput``.
        model: the model's name or path, recorded per run (default: the client's ``model_name``).
        sampling_params: the trainer's sampling parameters for this batch
        (``GeneratorInput["sampling_params"]``);
            keys :class:`Sampling` does not set are sent as given.
    """

    name = "skyrl"

    def __init__(self, client: Any, *, model: str = "",
                 sampling_params: Mapping[str, Any] | None = None) -> None:
        self.client = client
        if not model:
            try:
                model = str(getattr(client, "model_name", "") or "")
            except Exception:  # an abstract property a stand-in left out
                model = ""
        self.model = model
        self._passthrough = {k: v for k, v in dict(sampling_params or {}).items()
                             if k not in _OWN_KEYS and v is not None}
        #: Calls made, and seconds spent waiting on the engines (the trainer's generation time).
        self.calls = 0
        self.busy_s = 0.0
        #: The sessions sampled for, in first-call order (:meth:`finish_sessions` releases them).
        self.sessions: dict[str, None] = {}

    def sampling_params(self, sampling: Sampling) -> dict[str, Any]:
        """The ``sampling_params`` dict SkyRL's engines get for ``sampling``."""
        params: dict[str, Any] = {
            **self._passthrough,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,
            "max_tokens": sampling.max_tokens,
            "logprobs": 0,  # vLLM: the sampled token's own logprob, no alternatives
        }
        if sampling.stop_token_ids:
            params["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.seed is not None:
            params["seed"] = sampling.seed
        return params

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling) -> GenerateResult:
        """One answer from SkyRL's engines; the session being sampled routes it."""
        session = request_session.get() or f"ares-{uuid.uuid4().hex}"
        self.sessions.setdefault(session, None)
        request = {"prompts": None, "prompt_token_ids": [list(prompt_ids)],
                   "sampling_params": self.sampling_params(sampling), "session_ids": [session],
                   "mm_features": None, "cache_salt": None}
        t0 = time.perf_counter()
        try:
            out = await self.client.generate(request)
        except Exception as exc:
            raise EngineUnavailableError(
                f"SkyRL's inference_engine_client.generate failed: {type(exc).__name__}: {exc}") from exc
        finally:
            seconds = time.perf_counter() - t0
            self.calls += 1
            self.busy_s += seconds
        return self._result(out, len(prompt_ids), sampling, seconds)

    async def stream(self, prompt_ids: Sequence[int],
                     sampling: Sampling) -> AsyncIterator[TokenChunk | GenerateResult]:
        """The whole answer as one chunk, then the result."""
        result = await self.generate(prompt_ids, sampling)
        yield TokenChunk(ids=list(result.output_ids), logprobs=list(result.logprobs))
        yield result

    async def finish_sessions(self) -> int:
        """Tell SkyRL's router that every session sampled for is over (``finish_session``, best effort:
        it releases the replica capacity a session held); how many it acknowledged."""
        done = 0
        for session in list(self.sessions):
            self.sessions.pop(session, None)
            try:
                await self.client.finish_session(session)
                done += 1
            except Exception as exc:  # best effort, as SkyRL's own generators treat it
                log.debug("finish_session(%s) failed: %s: %s", session, type(exc).__name__, exc)
        return done

    async def aclose(self) -> None:
        """Nothing to release: the engines are SkyRL's."""

    def _result(self, out: Any, prompt_tokens: int, sampling: Sampling, seconds: float) -> GenerateResult:
        if (not isinstance(out, Mapping) or not isinstance(out.get("response_ids"), list)
            or len(out["response_ids"]) != 1):
            raise EngineResponseError(
                f"SkyRL's inference_engine_client.generate returned {type(out).__name__}, not an "
                "InferenceEngineOutput with one response_ids entry for the one prompt sent")
        ids = [int(t) for t in out["response_ids"][0]]
        reasons = out.get("stop_reasons") or [None]
        if reasons[0] == "abort":
            raise EngineUnavailableError(
                "SkyRL aborted the request (its engines were paused for a weight update)")
        lps = out.get("response_logprobs")
        if not lps or lps[0] is None:
            if ids:
                raise EngineResponseError(
                    "SkyRL's engine returned no response_logprobs: the samples need them; the "
                    "engine asks with logprobs=0, so check that the inference engine honours it "
                    "(generator.sampling_params.logprobs)")
            lps = [[]]
        logprobs = [float(x) for x in lps[0]]
        stopped = bool(ids) and ids[-1] in sampling.stop_token_ids
        finish: FinishReason = "length" if len(ids) >= sampling.max_tokens and not stopped else "stop"
        return GenerateResult(output_ids=ids, logprobs=logprobs, finish_reason=finish,
                              prompt_tokens=prompt_tokens, decode_s=seconds)
