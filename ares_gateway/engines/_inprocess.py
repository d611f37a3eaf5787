"""What the in-process engines (llama.cpp, transformers) share: sampling one token from logits, the
worker thread their calls run on, with ``generate`` / ``stream`` over it, and the label of the weights
they sample with (:class:`WorkerThreadEngine`)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ares_gateway.engines.base import EngineError, GenerateResult, Sampling, TokenChunk

__all__ = ["Emit", "WorkerThreadEngine", "logsumexp", "sample_token"]

Emit = Callable[[Any], None]


def sample_token(logits: np.ndarray[Any, Any], sampling: Sampling, rng: np.random.Generator) -> tuple[int,
                                                                                                      float]:
    """Draw one token from ``logits`` under ``sampling``; returns ``(token, logprob under that
    distribution)``.

    Temperature, then top-k, then top-p, renormalized (float64). ``temperature=0`` is greedy and its
    logprob is the log-softmax at temperature 1.
    """
    x = np.asarray(logits, dtype=np.float64)
    if sampling.temperature == 0:
        tok = int(np.argmax(x))
        return tok, float(x[tok] - logsumexp(x))
    with np.errstate(over="ignore", invalid="ignore"):
        z = x / sampling.temperature
    if np.isnan(z).any() or np.isposinf(z).any():
        # A temperature so small that the logits overflow: the same distribution, shifted below 0 first
        # (softmax ignores the shift), so that it samples the top tokens instead of drawing from NaN.
        with np.errstate(over="ignore", invalid="ignore"):
            z = (x - np.max(x)) / sampling.temperature
    if 0 < sampling.top_k < z.shape[0]:
        kth = np.partition(z, -sampling.top_k)[-sampling.top_k]
        z = np.where(z >= kth, z, -np.inf)
    logp = z - logsumexp(z)
    if sampling.top_p < 1.0:
        order = np.argsort(-logp, kind="stable")
        probs = np.exp(logp[order])
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        keep = int(np.searchsorted(np.cumsum(probs), sampling.top_p) + 1)
        mask = np.full(z.shape[0], -np.inf)
        mask[order[:keep]] = 0.0
        z = z + mask
        logp = z - logsumexp(z)
    p = np.exp(logp)
    tok = int(rng.choice(p.shape[0], p=p / p.sum()))
    return tok, float(logp[tok])


def _check_version(version: Any) -> int | None:
    if version is None:
        return None
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"a weight version is a non-negative integer (or None: unlabelled), got {version!r}")
    return version


def logsumexp(z: np.ndarray[Any, Any]) -> float:
    m = float(np.max(z))
    return m + math.log(float(np.sum(np.exp(z - m))))


class WorkerThreadEngine:
    """The part of an in-process engine around its sampler: one worker thread every call runs on, in
    arrival order (the model is never entered twice at once), ``generate``, ``stream`` and closing.

    A subclass sets :attr:`label` and implements ``_generate_sync(prompt, sampling, emit, stop)``:
    it calls ``emit(TokenChunk)`` per sampled token when ``emit`` is given, ends at its next token
    once ``stop`` is set (the consumer left: the agent disconnected, or an abort fence cancelled the
    call), and stamps its result with :meth:`_reported_version` as read when it starts.

    **Weight version.** :attr:`weight_version` is the trainer's label of the weights the engine samples
    with (its step, say), set with :meth:`set_weight_version` right after the weights change, under the
    gateway's fence (``async with gw.weight_update(v): mutate(); engine.set_weight_version(v)``), as SGLang's
    ``/update_weight_version`` sets its label. Each generation reports the label read when it starts
    (:attr:`GenerateResult.weight_version`), which the gateway records before the version set on it. The
    trainer names it, not a counter of the engine's own, because the engine's word takes precedence:
    it must be in the trainer's numbering.
    """

    #: How errors name the engine ("the llama.cpp engine is closed").
    label = "in-process"

    def __init__(self, *, thread_name: str, weight_version: int | None = None) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)
        self._closed = False
        self._weight_version = _check_version(weight_version)

    @property
    def weight_version(self) -> int | None:
        """The trainer's label of the weights sampled with now (``None``: unlabelled)."""
        return self._weight_version

    def set_weight_version(self, version: int | None) -> None:
        """Label the weights the engine samples with from now on: a non-negative integer, or ``None``
        (unlabelled: its results report no version, and the gateway's applies). Call it after the weights
        changed, while sampling is paused; a generation already running keeps the label it started with."""
        self._weight_version = _check_version(version)

    def _reported_version(self) -> int | None:
        """The version a generation starting now reports (read on the worker thread, as it starts)."""
        return self._weight_version

    def _generate_sync(self, prompt: list[int], sampling: Sampling, emit: Emit | None,
                       stop: threading.Event | None) -> GenerateResult:
        raise NotImplementedError

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError(f"the {self.label} engine is closed")

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        self._check_open()
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _close(self, release: Callable[[], None]) -> None:
        """Run ``release`` on the worker (after the calls queued before it), then stop the worker."""
        if self._closed:
            return
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(self._pool, release)
        self._pool.shutdown(wait=False)

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling) -> GenerateResult:
        self._check_open()
        stop = threading.Event()
        work = self._pool.submit(self._generate_sync, list(prompt_ids), sampling, None, stop)
        try:
            result: GenerateResult = await asyncio.wrap_future(work)
        except asyncio.CancelledError:
            # The caller left (an abort fence, an agent gone): a call not started never starts, a running
            # one stops at its next token, and the cancellation returns only once the worker is off the
            # model, so a weight update after an abort never runs beside a forward pass.
            if not work.cancel():
                stop.set()
                with contextlib.suppress(Exception):
                    await asyncio.shield(asyncio.wrap_future(work))
            raise
        return result

    async def stream(self, prompt_ids: Sequence[int],
                     sampling: Sampling) -> AsyncIterator[TokenChunk | GenerateResult]:
        """Like :meth:`generate`, yielding each sampled token as a :class:`TokenChunk`, then the result."""
        self._check_open()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenChunk | GenerateResult | BaseException] = asyncio.Queue()
        stop = threading.Event()
        prompt = list(prompt_ids)

        def emit(item: TokenChunk | GenerateResult | BaseException) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def work() -> None:
            try:
                emit(self._generate_sync(prompt, sampling, emit, stop))
            except BaseException as exc:  # handed to the consumer, raised there
                emit(exc)

        fut = loop.run_in_executor(self._pool, work)  # starts now, not when awaited
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, GenerateResult):
                    return
        finally:
            stop.set()  # the consumer left early (agent gone): stop sampling at the next token
            await asyncio.shield(fut)
