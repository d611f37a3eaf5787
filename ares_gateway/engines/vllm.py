"""vLLM's token-in/token-out endpoint ``POST /inference/v1/generate``.

Request (vLLM ``GenerateRequest``)::

    {"model": ..., "token_ids": [...], "sampling_params": {"max_tokens", "temperature", "top_p",
     "top_k", "seed"?, "stop_token_ids", "logprobs": 1, "skip_special_tokens": false}}

Answer: ``{"request_id", "choices": [{"token_ids": [...], "finish_reason": "stop"|"length"|...,
"logprobs": {"content": [{"token": "token_id:<id>", "logprob": x}, ...]}}], "usage"?}``.

vLLM reports the *raw* model logprobs unless the server runs with
``--logprobs-mode processed_logprobs``; start it that way so the recorded logprob is the one of
the distribution the token was sampled from (at temperature 1, no top-k/top-p, both agree).
A logprob of -9999.0 is vLLM's "no evidence" sentinel and is rejected. This endpoint does not
stream: :meth:`VLLMEngine.stream` yields the whole output as one chunk.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from typing import Any

from ares_gateway.engines._client import HttpEngineBase
from ares_gateway.engines.base import EngineResponseError, GenerateResult, Sampling, TokenChunk

__all__ = ["VLLMEngine"]

_SENTINEL = -9999.0


class VLLMEngine(HttpEngineBase):
    """A vLLM server (``vllm serve MODEL --logprobs-mode processed_logprobs``) at ``url``; ``model`` is its
    served name."""

    name = "vllm"

    def _body(self, prompt_ids: Sequence[int], sampling: Sampling) -> dict[str, Any]:
        sp: dict[str, Any] = {
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,
            "logprobs": 1,
            "skip_special_tokens": False,
        }
        if sampling.stop_token_ids:
            sp["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.seed is not None:
            sp["seed"] = sampling.seed
        return {"model": self.model, "token_ids": list(prompt_ids), "sampling_params": sp}

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling) -> GenerateResult:
        data = await self._post_json("/inference/v1/generate", self._body(prompt_ids, sampling))
        if not isinstance(data, dict) or not isinstance(data.get("choices"), list) or not data["choices"]:
            raise EngineResponseError("vllm: the answer has no choices")
        choice = data["choices"][0]
        if not isinstance(choice, dict):
            raise EngineResponseError("vllm: choices[0] is not an object")
        ids = choice.get("token_ids")
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise EngineResponseError("vllm: choices[0].token_ids is missing or not a list of ints")
        lps = _logprobs(choice, ids)
        fr = choice.get("finish_reason")
        if fr == "abort":
            raise EngineResponseError("vllm aborted the request")
        usage = data.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return GenerateResult(
            output_ids=list(ids),
            logprobs=lps,
            finish_reason="length" if fr == "length" else "stop",
            prompt_tokens=int(usage.get("prompt_tokens") or len(prompt_ids)),
            cached_tokens=int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0,
            extra={"id": data.get("request_id")},
        )

    async def stream(self, prompt_ids: Sequence[int],
                     sampling: Sampling) -> AsyncIterator[TokenChunk | GenerateResult]:
        result = await self.generate(prompt_ids, sampling)
        if result.output_ids:
            yield TokenChunk(list(result.output_ids), list(result.logprobs))
        yield result


def _logprobs(choice: dict[str, Any], ids: list[int]) -> list[float]:
    lp = choice.get("logprobs")
    content = lp.get("content") if isinstance(lp, dict) else None
    if not isinstance(content, list):
        raise EngineResponseError(
            "vllm: choices[0].logprobs.content is missing (the request asks logprobs=1)")
    if len(content) != len(ids):
        raise EngineResponseError(f"vllm: {len(ids)} token ids but {len(content)} logprob entries")
    out: list[float] = []
    for i, (entry, tid) in enumerate(zip(content, ids, strict=True)):
        if not isinstance(entry, dict):
            raise EngineResponseError(f"vllm: logprobs.content[{i}] is not an object")
        token = entry.get("token")
        # "token_id:<id>" where vLLM returns tokens as ids (its tokens-only mode); otherwise the text.
        if isinstance(token, str) and token.startswith("token_id:") and token != f"token_id:{tid}":
            raise EngineResponseError(f"vllm: logprobs.content[{i}] is for {token!r}, not token_id:{tid}")
        v = entry.get("logprob")
        if (isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(float(v))
            or float(v) == _SENTINEL):
            raise EngineResponseError(f"vllm: logprobs.content[{i}].logprob is not a usable number: {v!r}")
        out.append(float(v))
    return out
