"""In-process ``transformers`` causal LM: the trainer's live model samples the agents' turns.

:class:`TransformersEngine` wraps a ``transformers`` model object, not a copy: whatever the trainer's
optimizer did to its weights, the next call samples from. Ids in, sampled ids and their logprobs out,
like every :class:`~ares_gateway.engines.Engine`; the gateway renders and parses.

**Sampling and logprobs.** The logits of the model's forward pass (float32 on CPU: keep the model in
float32 where sampler and trainer must agree; bfloat16 logprobs differ from a trainer's by up to ~0.1
nats) are sampled in numpy exactly as the llama.cpp engine does
(:func:`~ares_gateway.engines._inprocess.sample_token`):
temperature, top-k, top-p, renormalized; the recorded logprob is the token's under that distribution,
the log-softmax at temperature 1.0 without top-k/top-p: what the trainer recomputes.

**Concurrency: serialized.** Every call runs on the engine's one worker thread, in arrival order; the
model is never entered by two episodes at once, and the trainer is not running while its rollout
function waits. Concurrent episodes interleave turn by turn. Serializing rather than batching keeps
each sequence's numbers independent of what else was in the batch (padding changes a row's logits in
the last bits) and costs little on CPU, where one sequence already uses the cores
(``bench/bench_training.py`` measures it).

**Prefix cache.** The KV caches of the last ``max_cached_sequences`` calls are kept; a prompt that
extends one (the next turn of a session) evaluates only its new tokens. Caches are dropped when the
weights change: each is tagged with the parameters' in-place version counters, which ``load_state_dict``,
``copy_`` and the foreach / for-loop optimizers advance. Fused optimizers (``torch.optim.AdamW(fused=True)``,
transformers' default ``adamw_torch_fused``) update the weights without advancing them: whoever updates
weights that way calls :meth:`TransformersEngine.reset` before sampling again (the TRL adapter does, at
every rollout call).

**Weight version.** The trainer labels the weights with :meth:`~TransformersEngine.set_weight_version`
after changing them (under the gateway's fence), and each generation reports the label as it starts
(``GenerateResult.weight_version``, recorded as the turn's policy version). A label holds only for the
weights it was set on: once a parameter is modified in place again (the counters above) or
:meth:`~TransformersEngine.reset` is called, generations report no version until the next label, so an
optimizer step nobody labelled never passes for the labelled weights.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ares_gateway.engines._inprocess import Emit, WorkerThreadEngine, logsumexp, sample_token
from ares_gateway.engines.base import (
    EngineError,
    EngineUnavailableError,
    GenerateResult,
    PromptTooLongError,
    Sampling,
    TokenChunk,
)

__all__ = ["TransformersEngine"]

_EXTRA_HINT = "python3 -m pip install 'ares-gateway[trl]' (torch and transformers)"


def _torch() -> Any:
    try:
        import torch
    except Exception as exc:
        raise EngineUnavailableError(
            f"torch is not installed ({exc}): install it with {_EXTRA_HINT}") from exc
    return torch


class _Cached:
    """One sequence's KV cache: the ids it holds, the weights' version it was computed under."""

    __slots__ = ("cache", "ids", "version")

    def __init__(self, ids: list[int], cache: Any, version: int) -> None:
        self.ids = ids
        self.cache = cache
        self.version = version


class TransformersEngine(WorkerThreadEngine):
    """Samples with a ``transformers`` causal LM in this process.

    Args:
        model: the model object (e.g. the trainer's ``trainer.model``); used as it is, never copied.
        name: what runs record as the model (default: the model's ``name_or_path``).
        max_cached_sequences: KV caches kept for prefix reuse (each holds ~46 KB a token for SmolLM2-135M).
        context: the most tokens a prompt plus its answer may have (default: the model's
            ``max_position_embeddings``).
        threads: torch intra-op threads for the engine's calls (default: torch's setting).
        weight_version: the label of the model's weights as given (see :meth:`set_weight_version`;
            ``None``: unlabelled).
    """

    name = "transformers"
    label = "transformers"

    def __init__(
        self,
        model: Any,
        *,
        name: str | None = None,
        max_cached_sequences: int = 4,
        context: int | None = None,
        threads: int | None = None,
        weight_version: int | None = None,
    ) -> None:
        if not callable(model) or not hasattr(model, "parameters"):
            raise TypeError(
                f"model must be a transformers causal LM (a torch module), got {type(model).__name__}")
        if max_cached_sequences < 0:
            raise ValueError(f"max_cached_sequences must be >= 0, got {max_cached_sequences}")
        self.module = model
        config = getattr(model, "config", None)
        self.model = name or str(getattr(config, "name_or_path", "") or getattr(config, "_name_or_path", "")
                                 or type(model).__name__)
        self.n_ctx = int(context or getattr(config, "max_position_embeddings", 0) or 2048)
        self.max_cached_sequences = max_cached_sequences
        self.threads = threads
        super().__init__(thread_name="ares-transformers", weight_version=weight_version)
        # The label and the parameters' version counters it was set on, replaced together (one attribute:
        # the worker thread reads it while the trainer's thread may set it).
        self._label: tuple[int | None, int] = (self._weight_version, self.weights_version())
        self._caches: list[_Cached] = []  # most recently used last
        self.calls = 0
        self.busy_s = 0.0  # seconds the worker spent in calls (prefill + decode)

    @classmethod
    def from_pretrained(cls, path: str, *, gguf_file: str | None = None,
                        **options: Any) -> TransformersEngine:
        """Load a model (float32) from a Hugging Face folder, or a GGUF file in it (dequantized)."""
        _torch()
        try:
            from transformers import AutoModelForCausalLM
        except Exception as exc:
            raise EngineUnavailableError(
                f"transformers is not installed ({exc}): install it with {_EXTRA_HINT}") from exc
        if gguf_file is None and path.endswith(".gguf"):
            path, gguf_file = os.path.dirname(path) or ".", os.path.basename(path)
        model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file, dtype="float32")
        return cls(model, **options)

    # ------------------------------------------------------------- lifecycle
    async def load(self) -> None:
        """Nothing to load: the model object is live. Checks that torch imports."""
        _torch()

    def reset(self) -> None:
        """Drop every kept KV cache (they are dropped by themselves when the weights change) and the
        weights' label: a reset says the weights changed in a way the engine may not see."""
        self._caches.clear()
        self.set_weight_version(None)

    def set_weight_version(self, version: int | None) -> None:
        """Label the model's weights as they are now (see the module docstring: the label lapses when a
        parameter is modified again)."""
        super().set_weight_version(version)
        self._label = (self._weight_version, self.weights_version())

    @property
    def weight_version(self) -> int | None:
        """The label of the weights sampled with now: ``None`` when unlabelled, or when the weights were
        modified since they were labelled."""
        return self._reported_version()

    def _reported_version(self) -> int | None:
        version, counters = self._label
        return version if version is not None and counters == self.weights_version() else None

    async def aclose(self) -> None:
        """Stop the worker thread and drop the caches; the model itself belongs to its owner."""
        await self._close(self.reset)

    def weights_version(self) -> int:
        """A number that changes whenever a parameter is modified in place (optimizer steps do)."""
        return sum(int(p._version) for p in self.module.parameters())

    @contextlib.contextmanager
    def _evaluating(self) -> Iterator[Any]:
        torch = _torch()
        was_training = bool(getattr(self.module, "training", False))
        old_threads = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)
        self.module.eval()  # no dropout: the sampled distribution is the one the trainer scores
        try:
            with torch.inference_mode():
                yield torch
        finally:
            if was_training:
                self.module.train()
            if self.threads:
                torch.set_num_threads(old_threads)

    def _take_cache(self, prompt: list[int], version: int) -> tuple[Any, int]:
        """The kept cache sharing the longest prefix with ``prompt`` (cropped to it), or a new one."""
        from transformers import DynamicCache

        self._caches = [c for c in self._caches if c.version == version]
        best: _Cached | None = None
        best_n = 0
        for c in self._caches:
            n = 0
            for a, b in zip(c.ids, prompt, strict=False):
                if a != b:
                    break
                n += 1
            if n > best_n:
                best, best_n = c, n
        # At least the prompt's last token is evaluated: its logits give the first answer token.
        keep = min(best_n, len(prompt) - 1)
        if best is None or keep <= 0:
            return DynamicCache(), 0
        self._caches.remove(best)
        if keep < len(best.ids):
            # A negative count removes that many tokens from the end in every transformers 5.x (a
            # positive one kept that many before 5.24, and is refused since).
            best.cache.crop(keep - len(best.ids))
        return best.cache, keep

    def _keep(self, ids: list[int], cache: Any, version: int) -> None:
        if self.max_cached_sequences == 0:
            return
        self._caches.append(_Cached(ids, cache, version))
        del self._caches[: max(0, len(self._caches) - self.max_cached_sequences)]

    def _generate_sync(self, prompt: list[int], sampling: Sampling, emit: Emit | None,
                       stop: threading.Event | None) -> GenerateResult:
        if not prompt:
            raise EngineError("an empty prompt: nothing to continue")
        if len(prompt) >= self.n_ctx:
            raise PromptTooLongError(len(prompt), self.n_ctx)
        max_new = min(sampling.max_tokens, self.n_ctx - len(prompt))
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        rng = np.random.default_rng(seed)
        stop_ids = frozenset(sampling.stop_token_ids)
        t0 = time.perf_counter()
        with self._evaluating() as torch:
            version = self.weights_version()
            label, counters = self._label
            weight_version = label if counters == version else None
            cache, keep = self._take_cache(prompt, version)
            cached = list(prompt[:keep])

            def forward(tokens: list[int]) -> np.ndarray[Any, Any]:
                ids = torch.tensor([tokens], dtype=torch.long)
                pos = torch.arange(len(cached), len(cached) + len(tokens), dtype=torch.long)
                out = self.module(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=pos,
                                  position_ids=pos.unsqueeze(0), logits_to_keep=1)
                cached.extend(tokens)
                return out.logits[0, -1].float().numpy()

            try:
                logits = forward(prompt[keep:])
                t1 = time.perf_counter()
                out_ids: list[int] = []
                lps: list[float] = []
                finish: Any = "length"
                while True:
                    tok, lp = sample_token(logits, sampling, rng)
                    out_ids.append(tok)
                    lps.append(lp)
                    if emit is not None:
                        emit(TokenChunk([tok], [lp]))
                    if tok in stop_ids:
                        finish = "stop"
                        break
                    if len(out_ids) >= max_new or (stop is not None and stop.is_set()):
                        break
                    logits = forward([tok])
            except Exception as exc:  # a model error: the cache may be half-written, drop it
                raise EngineError(f"the transformers model failed: {type(exc).__name__}: {exc}") from exc
            self._keep(cached, cache, version)
        t2 = time.perf_counter()
        self.calls += 1
        self.busy_s += t2 - t0
        return GenerateResult(
            output_ids=out_ids,
            logprobs=lps,
            finish_reason=finish,
            prompt_tokens=len(prompt),
            cached_tokens=keep,
            prefill_s=t1 - t0,
            decode_s=t2 - t1,
            extra={"seed": seed, "weights_version": version},
            weight_version=weight_version,
        )

    # ------------------------------------------------------------ evaluation
    async def score(self, token_ids: Sequence[int], start: int) -> list[float]:
        """Log-softmax logprob of ``token_ids[k]`` given ``token_ids[:k]`` for ``k >= start``, in one
        teacher-forced pass (no cache): what a trainer computes."""
        ids = list(token_ids)
        if not 1 <= start < len(ids):
            raise ValueError(f"start must be in [1, {len(ids)}), got {start}")
        return list(await self._run(self._score_sync, ids, start))

    def _score_sync(self, ids: list[int], start: int) -> list[float]:
        with self._evaluating() as torch:
            logits = self.module(input_ids=torch.tensor([ids], dtype=torch.long)).logits[0].double().numpy()
        return [float(logits[k - 1, ids[k]] - logsumexp(logits[k - 1])) for k in range(start, len(ids))]
