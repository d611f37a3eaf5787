"""SGLang's native ``/generate`` endpoint, token in / token out.

Request (SGLang ``GenerateReqInput``)::

    {"input_ids": [...], "sampling_params": {"max_new_tokens", "temperature", "top_p", "top_k",
     "stop_token_ids", "skip_special_tokens": false, "no_stop_trim": true, "sampling_seed"?},
     "return_logprob": true, "logprob_start_len": -1, "stream": false}

Answer: ``{"text", "output_ids": [...], "meta_info": {"finish_reason": {"type": "stop"|"length"|"abort", ...},
"prompt_tokens", "completion_tokens", "cached_tokens", "output_token_logprobs": [[logprob, token_id, text],
...],
"weight_version"}}``.
Streaming answers are server-sent events (``data: {...}`` ... ``data: [DONE]``) with the same
objects; their ``output_token_logprobs`` are cumulative (or incremental under
``--incremental-streaming-output``): both are handled, by comparing with ``completion_tokens``.

The ids are taken from ``output_token_logprobs`` (one entry per sampled token, so ids and
logprobs cannot disagree) and checked against ``output_ids`` when the answer has both.
Which distribution SGLang's logprobs are taken under depends on its version and flags; at
temperature 1 with top-k/top-p off every definition is the model's log-softmax.

``meta_info.weight_version`` is SGLang's label of the weights it serves (a string: ``--weight-version``
at launch, default ``"default"``; the ``weight_version`` of ``/update_weights_from_*`` or
``/update_weight_version`` after). When it is a decimal integer (``"7"``, or a number) it is the
turn's policy version (:attr:`GenerateResult.weight_version`); any other label is no version, and
the turn takes the gateway's. SGLang stamps the version it serves when the answer is built, so a
generation that an update overtook carries the newer one: fence updates (pause sampling) to be exact.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Sequence
from typing import Any

from ares_gateway.engines._client import HttpEngineBase
from ares_gateway.engines.base import (
    EngineError,
    EngineResponseError,
    GenerateResult,
    PromptTooLongError,
    Sampling,
    TokenChunk,
)

__all__ = ["SGLangEngine"]

# A 400 for a prompt longer than the context: SGLang's wording, and ares' EngineServer's
# (PromptTooLongError's).
_TOO_LONG = (
    re.compile(r"input \((\d+) tokens\) is longer than the model's context length \((\d+) tokens\)"),
    re.compile(r"prompt has (\d+) tokens but the engine's context holds (\d+)"),
)


class SGLangEngine(HttpEngineBase):
    """An SGLang server (``python -m sglang.launch_server``) at ``url``. See :class:`HttpEngineBase` for
    options."""

    name = "sglang"

    def _http_error(self, url: str, status: int, text: str) -> EngineError:
        # A too-long prompt is the same error as from an in-process engine (the agent gets a 400, not a 502).
        if status == 400:
            for pattern in _TOO_LONG:
                m = pattern.search(text)
                if m:
                    return PromptTooLongError(int(m.group(1)), int(m.group(2)))
        return super()._http_error(url, status, text)

    def _body(self, prompt_ids: Sequence[int], sampling: Sampling, stream: bool) -> dict[str, Any]:
        sp: dict[str, Any] = {
            "max_new_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        if sampling.stop_token_ids:
            sp["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.seed is not None:
            sp["sampling_seed"] = sampling.seed
        return {
            "input_ids": list(prompt_ids),
            "sampling_params": sp,
            "return_logprob": True,
            "logprob_start_len": -1,
            "stream": stream,
        }

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling) -> GenerateResult:
        data = await self._post_json("/generate", self._body(prompt_ids, sampling, False))
        if isinstance(data, list) and len(data) == 1:
            data = data[0]
        ids, lps = _token_logprobs(data)
        out = data.get("output_ids")
        if isinstance(out, list) and out and out != ids[: len(out)]:
            raise EngineResponseError("sglang: output_ids and output_token_logprobs name different tokens")
        return _result(data, ids, lps, len(prompt_ids))

    async def stream(self, prompt_ids: Sequence[int],
                     sampling: Sampling) -> AsyncIterator[TokenChunk | GenerateResult]:
        ids: list[int] = []
        lps: list[float] = []
        last: dict[str, Any] | None = None
        async for event in self._post_sse("/generate", self._body(prompt_ids, sampling, True)):
            if not isinstance(event, dict):
                raise EngineResponseError(f"sglang streamed a {type(event).__name__}, not an object")
            new_ids, new_lps = _token_logprobs(event)
            meta = event.get("meta_info") or {}
            done = meta.get("completion_tokens")
            if isinstance(done, int) and len(new_ids) == done and len(new_ids) >= len(ids):
                # cumulative: the new part is what follows what we have
                if new_ids[: len(ids)] != ids:
                    raise EngineResponseError("sglang: a streamed chunk rewrote earlier tokens")
                new_ids, new_lps = new_ids[len(ids) :], new_lps[len(ids) :]
            if new_ids:
                ids.extend(new_ids)
                lps.extend(new_lps)
                yield TokenChunk(new_ids, new_lps)
            last = event
        if last is None:
            raise EngineResponseError("sglang: the stream ended before any event")
        yield _result(last, ids, lps, len(prompt_ids))


def _token_logprobs(data: Any) -> tuple[list[int], list[float]]:
    if not isinstance(data, dict) or not isinstance(data.get("meta_info"), dict):
        raise EngineResponseError("sglang: the answer has no meta_info object")
    entries = data["meta_info"].get("output_token_logprobs")
    if not isinstance(entries, list):
        raise EngineResponseError(
            "sglang: meta_info.output_token_logprobs is missing: the request sets return_logprob")
    ids: list[int] = []
    lps: list[float] = []
    for i, e in enumerate(entries):
        if (not isinstance(e, list | tuple) or len(e) < 2 or not isinstance(e[1], int)
            or not isinstance(e[0], int | float)):
            raise EngineResponseError(
                f"sglang: output_token_logprobs[{i}] is not [logprob, token_id, ...]: {e!r}")
        lps.append(float(e[0]))
        ids.append(int(e[1]))
    return ids, lps


def _result(data: dict[str, Any], ids: list[int], lps: list[float], prompt_len: int) -> GenerateResult:
    meta = data.get("meta_info") or {}
    fr = meta.get("finish_reason")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind == "abort":
        msg = fr.get("message") if isinstance(fr, dict) else None
        raise EngineResponseError(f"sglang aborted the request: {msg or fr!r}")
    finish: Any = "length" if kind == "length" else "stop"
    return GenerateResult(
        output_ids=ids,
        logprobs=lps,
        finish_reason=finish,
        prompt_tokens=int(meta.get("prompt_tokens") or prompt_len),
        cached_tokens=int(meta.get("cached_tokens") or 0),
        # The seed a sampling_seed-less request was sampled with, where the server says (ares' EngineServer
        # does; SGLang does not): the turn record keeps it, as with an in-process engine.
        extra={"id": meta.get("id"),
               **({"seed": seed} if isinstance(seed := meta.get("sampling_seed"), int) else {})},
        weight_version=_weight_version(meta.get("weight_version")),
    )


def _weight_version(value: Any) -> int | None:
    """SGLang's ``weight_version`` as a policy version: a non-negative integer, or a string of decimal
    digits; any other label (its default ``"default"``, ``"v5"``) is none."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value >= 0 else None
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 18:
        return int(value)
    return None
