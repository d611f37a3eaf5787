"""The ``tito`` policy: token in, token out. The gateway renders, an engine samples, the gateway parses.

Each parked request is rendered to prompt ids by the session's :class:`~ares_gateway.tokens.TokenStreams`
(the previous turn's exact prompt + sampled ids + only the new messages' tokens, or a counted fresh
render when the agent rewrote history), sampled by an :class:`~ares_gateway.engines.Engine`, and
the sampled ids are parsed back into a canonical :class:`~ares_gateway.Completion` whose
``tokens`` (:class:`~ares_gateway.canonical.TokenRecord`) are exactly what the engine saw and
produced, with the engine's logprobs. ``completion.extra["tito"]`` carries the per-turn record:
how the prompt was built (``mode``: first / extend / fresh, and why), the sampling parameters
(temperature, top_p, top_k, seed, max_tokens), engine, model, timings.

>>> policy = make_policy("tito", engine="llama-cpp")          # the embedded SmolLM2 on CPU
>>> policy = make_policy("tito", engine="sglang", url="http://127.0.0.1:30000", tokenizer="/models/qwen3")
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from ares_gateway.core.broker import ParkedRequest
from ares_gateway.core.canonical import CanonicalRequest, Completion, CompletionDelta, TokenRecord
from ares_gateway.engines import (
    Engine,
    EngineError,
    EngineUnavailableError,
    PromptTooLongError,
    Sampling,
    make_engine,
)
from ares_gateway.engines.base import GenerateResult, TokenChunk, request_session
from ares_gateway.policies.base import PolicyError, PolicyRequest, canonical_of
from ares_gateway.tokens import ChatRenderer, Prepared, RenderError, StreamStats, TokenStreams

log = logging.getLogger(__name__)

__all__ = ["TitoPolicy", "episode_fidelity"]

_DIRECT_SESSION = "direct"


class TitoPolicy:
    """Answers requests with an engine over exact token streams.

    Args:
        engine: an :class:`Engine`, or a name for :func:`~ares_gateway.engines.make_engine`
            (``llama-cpp`` default, ``sglang``, ``vllm``).
        model: for ``llama-cpp`` the GGUF path (``None``: embedded SmolLM2-135M-Instruct); for HTTP
            engines the served model name.
        tokenizer: where the tokenizer + chat template come from (a ``.gguf`` file or a Hugging Face
            directory); default: ``model`` for ``llama-cpp``. HTTP engines need it.
        renderer: a ``renderers`` renderer name (``None``: by model name, else the model's own template),
            or a ready :class:`ChatRenderer` (share one between policies of the same model).
        temperature / top_p / top_k / seed: sampling (defaults: 1.0, off, off, drawn per turn and recorded).
            With ``seed`` set, each turn's seed is derived from it, the session and the turn number.
        max_tokens: the most tokens one answer may have (the agent's ``max_tokens`` can only lower it).
        honor_request_sampling: take temperature / top_p / top_k / seed from the request where it sets them.
        stream: relay tokens to streaming agents as they are sampled (text-only formats; others get the
            whole answer at the end).
        url: shortcut for HTTP engines' ``url`` option; ``engine_options``: more engine options.
        max_turns_kept: per session, recent turns kept for extension (see :class:`TokenStreams`).
    """

    kind = "tito"

    def __init__(
        self,
        engine: Engine | str = "llama-cpp",
        *,
        model: str | None = None,
        tokenizer: str | None = None,
        renderer: str | ChatRenderer | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        max_tokens: int = 512,
        honor_request_sampling: bool = False,
        stream: bool = True,
        url: str | None = None,
        engine_options: dict[str, Any] | None = None,
        max_turns_kept: int = 32,
    ) -> None:
        opts = dict(engine_options or {})
        # What a copy in another process is built from (a Ray actor): the same settings, its own
        # engine copy, renderer and token streams, no session of this one's.
        self._settings = {"tokenizer": tokenizer, "temperature": temperature, "top_p": top_p, "top_k": top_k,
                          "seed": seed, "max_tokens": max_tokens,
                          "honor_request_sampling": honor_request_sampling,
                          "stream": stream, "max_turns_kept": max_turns_kept}
        if isinstance(engine, str):
            if engine in ("llama-cpp", "llama_cpp", "llamacpp"):
                if model is not None:
                    opts.setdefault("model_path", model)
            else:
                if url is not None:
                    opts.setdefault("url", url)
                if "url" not in opts:
                    raise ValueError(f"the {engine} engine needs url= (e.g. http://127.0.0.1:30000)")
                opts.setdefault("model", model or "")
            engine = make_engine(engine, **opts)
        self.engine: Engine = engine
        if isinstance(renderer, ChatRenderer):
            self.renderer = renderer
        else:
            source = tokenizer
            if source is None and self.engine.name == "llama-cpp":
                source = self.engine.model
            if source is None:
                raise ValueError(
                    f"the {self.engine.name} engine needs tokenizer= (the model's .gguf file or Hugging Face "
                    "directory): the gateway renders prompts itself"
                )
            self.renderer = ChatRenderer(source, renderer=renderer)
        self.defaults = Sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                 seed=seed)
        self.honor_request_sampling = honor_request_sampling
        self.stream = stream
        self.streams = TokenStreams(self.renderer, max_turns_kept=max_turns_kept)
        #: The ``extra["tito"]`` record of the latest answer (for benchmarks and debugging).
        self.last_record: dict[str, Any] | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.engine, self.renderer, self._settings))

    # ------------------------------------------------------------- reporting
    def stats(self, session_id: str) -> StreamStats:
        """Fidelity counters of a session: turns, extended, first, fresh (with reasons), streams."""
        return self.streams.stats(session_id)

    def run_info(self) -> dict[str, Any]:
        """What a run records about this policy: kind, engine, model, renderer, default sampling."""
        return {
            "policy": self.kind,
            "engine": self.engine.name,
            "model": self.engine.model,
            "renderer": self.renderer.name,
            "sampling": self.defaults.to_record(),
            "honor_request_sampling": self.honor_request_sampling,
        }

    def forget(self, session_id: str) -> StreamStats | None:
        """Drop a finished session's token streams (memory); returns its final counters."""
        return self.streams.drop(session_id)

    def episode_report(self, session_id: str, samples: Sequence[Any]) -> dict[str, Any]:
        """:func:`episode_fidelity` of a finished session's ``samples`` (what ``run`` writes per episode
        to ``results.json``), then the session's streams are dropped."""
        report = episode_fidelity(samples, self.stats(session_id))
        self.forget(session_id)
        return report

    @property
    def tool_calls_supported(self) -> bool:
        """Whether the model's renderer has a tool-call format (else tools are not shown to the model,
        and an agent must be run in a text-action mode, e.g. mini-swe-agent's ``action_format="text"``)."""
        # Hand-written renderers parse their family's tool calls; the generic template only with a parser.
        return (not self.renderer.is_template
                or getattr(self.renderer.renderer, "_tool_parser", None) is not None)

    def harness_options(self, harness: str, *, action_regex: str | None = None) -> dict[str, Any]:
        """The harness options this model needs: mini-swe-agent runs in its text-action mode for a model
        without a tool-call format (SmolLM2)."""
        if harness == "mini-swe-agent" and not self.tool_calls_supported:
            return {"action_format": "text", **({"action_regex": action_regex} if action_regex else {})}
        return {}

    async def __aenter__(self) -> TitoPolicy:
        """Load the engine's model now (``run`` enters the policy before any sandbox starts), so a
        missing or crashing build fails the run up front with its install command."""
        load = getattr(self.engine, "load", None)
        if load is not None:
            try:
                await load()
            except EngineError as exc:
                raise PolicyError(str(exc), status=503) from exc
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.engine.aclose()

    # ---------------------------------------------------------------- answer
    def _sampling(self, req: CanonicalRequest, session_id: str) -> Sampling:
        d = self.defaults
        temperature, top_p, top_k, seed = d.temperature, d.top_p, d.top_k, d.seed
        s = req.sampling
        if self.honor_request_sampling:
            temperature = s.temperature if s.temperature is not None else temperature
            top_p = s.top_p if s.top_p is not None else top_p
            top_k = s.top_k if s.top_k is not None else top_k
            seed = s.seed if s.seed is not None else seed
        n = self.streams.request_number(session_id)
        if seed is not None and not (self.honor_request_sampling and s.seed is not None):
            digest = hashlib.sha256(f"{seed}/{session_id}/{n}".encode()).digest()
            seed = int.from_bytes(digest[:8], "little") >> 1
        max_tokens = min(d.max_tokens, s.max_tokens) if s.max_tokens else d.max_tokens
        return Sampling(
            max_tokens=max(1, max_tokens),
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop_token_ids=tuple(self.renderer.stop_token_ids),
        )

    async def _prepare(self, request: PolicyRequest) -> tuple[CanonicalRequest, Prepared, Sampling]:
        req = canonical_of(request)
        sid = request.session_id if isinstance(request, ParkedRequest) else _DIRECT_SESSION
        try:
            # Rendering / tokenizing a long history is CPU work: keep it off the event loop.
            prepared = await asyncio.to_thread(self.streams.prepare, sid, req.messages, req.tools)
        except RenderError as exc:
            raise PolicyError(str(exc), status=400) from exc
        return req, prepared, self._sampling(req, sid)

    def _finish(self, req: CanonicalRequest, prepared: Prepared, sampling: Sampling,
                result: GenerateResult) -> Completion:
        completion, broken = self.renderer.parse(
            result.output_ids,
            prompt_ids=prepared.prompt_ids,
            tools=prepared.template_tools,
            finish_reason=result.finish_reason,
        )
        record = sampling.to_record()
        if record["seed"] is None:
            record["seed"] = result.extra.get("seed")
        tito: dict[str, Any] = {
            "mode": prepared.mode,
            "reason": prepared.reason,
            "stream": prepared.stream,
            "engine": self.engine.name,
            "model": self.engine.model,
            "renderer": self.renderer.name,
            "sampling": record,
            "prompt_tokens": len(prepared.prompt_ids),
            "extended_tokens": prepared.base_prompt_tokens,
            "output_tokens": len(result.output_ids),
            "cached_tokens": result.cached_tokens,
            "prefill_s": round(result.prefill_s, 6),
            "decode_s": round(result.decode_s, 6),
        }
        if broken:
            tito["ill_formed_tool_calls"] = broken
        completion = completion.model_copy(
            update={
                # Validated into int32 / float64 arrays.
                "tokens": TokenRecord.model_validate({
                    "prompt_ids": prepared.prompt_ids,
                    "output_ids": result.output_ids,
                    "output_logprobs": result.logprobs,
                    "finish_reason": result.finish_reason,
                }),
                "model": req.model or self.engine.model,
                "extra": {**completion.extra, "tito": tito},
                # The engine's own word on which weights sampled it; without it the gateway's applies.
                "policy_version": result.weight_version,
            }
        )
        self.streams.commit(prepared, result.output_ids, completion.to_message())
        self.last_record = tito
        return completion

    async def __call__(self,
                       request: PolicyRequest) -> Completion | AsyncIterator[CompletionDelta | Completion]:
        req, prepared, sampling = await self._prepare(request)
        if req.stream and self.stream and self._streams_text():
            return self._streamed(req, prepared, sampling)
        # Set, not reset, where the engine is called: this task (the episode's, or the request's) samples
        # for this session; an engine routing by session (verl's server manager) reads it.
        request_session.set(prepared.session_id)
        try:
            result = await self.engine.generate(prepared.prompt_ids, sampling)
        except EngineError as exc:
            raise _policy_error(exc) from exc
        return self._finish(req, prepared, sampling, result)

    def _streams_text(self) -> bool:
        # Deltas are plain decoded text: only where the whole answer parses as text (no tool or
        # reasoning format to split out), so what the agent is streamed equals what is recorded.
        r = self.renderer.renderer
        return self.renderer.is_template and getattr(r, "_tool_parser", None) is None and getattr(
            r, "_reasoning_parser", None
        ) is None

    async def _streamed(
        self, req: CanonicalRequest, prepared: Prepared, sampling: Sampling
    ) -> AsyncIterator[CompletionDelta | Completion]:
        tok = self.renderer.tokenizer
        special = set(tok.all_special_ids)
        ids: list[int] = []
        sent = ""
        result: GenerateResult | None = None
        request_session.set(prepared.session_id)
        try:
            async for item in self.engine.stream(prepared.prompt_ids, sampling):
                if isinstance(item, GenerateResult):
                    result = item
                    break
                assert isinstance(item, TokenChunk)
                ids.extend(t for t in item.ids if t not in special)
                text = tok.decode(ids)
                if text.endswith("\ufffd"):
                    continue  # an incomplete UTF-8 sequence: wait for the rest of the character
                if text.startswith(sent) and len(text) > len(sent):
                    yield CompletionDelta(text=text[len(sent) :])
                    sent = text
        except EngineError as exc:
            raise _policy_error(exc) from exc
        if result is None:
            raise PolicyError("the engine's stream ended without a result", status=502)
        completion = self._finish(req, prepared, sampling, result)
        final = completion.text or ""
        if final.startswith(sent) and len(final) > len(sent):
            yield CompletionDelta(text=final[len(sent) :])
        elif not final.startswith(sent):
            log.warning("tito: streamed text and parsed answer differ; the parsed answer is recorded")
        yield completion


def episode_fidelity(samples: Sequence[Any], stats: StreamStats) -> dict[str, Any]:
    """What ``run`` reports per episode: turns, trained tokens, fresh renders, main-line drift.

    ``samples`` are the episode's :class:`trajectory.Sample` objects. A sample that starts with
    ``start_reason == "drift"`` begins where a turn's prompt did not continue its base turn; each
    fresh render (history rewritten) may legitimately cause one, so main-line drift is the number
    of drift starts beyond the fresh renders: 0 when every extension held.
    """
    drift_starts = sum(1 for s in samples if s.metadata.get("start_reason") == "drift")
    return {
        "turns": stats.turns,
        "trained_tokens": int(sum(int(s.loss_mask.sum()) for s in samples)),
        "samples": len(samples),
        "extended": stats.extended,
        "fresh_renders": stats.fresh,
        "fresh_reasons": list(stats.fresh_reasons),
        "main_line_drift": max(0, drift_starts - stats.fresh),
    }


def _policy_error(exc: EngineError) -> PolicyError:
    if isinstance(exc, PromptTooLongError):
        return PolicyError(str(exc), status=400)
    if isinstance(exc, EngineUnavailableError):
        return PolicyError(str(exc), status=503)
    return PolicyError(f"the engine failed: {exc}", status=502)


def _rebuild(engine: Engine, renderer: ChatRenderer, settings: dict[str, Any]) -> TitoPolicy:
    """:meth:`TitoPolicy.__reduce__`'s other half."""
    return TitoPolicy(engine, renderer=renderer, **settings)
