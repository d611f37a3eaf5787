"""What the in-process engines (llama.cpp, transformers) share: sampling one token from logits, and
the worker thread their calls run on, with ``generate`` / ``stream`` over it (:class:`WorkerThreadEngine`)."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ares_gateway.engines.base import EngineError, GenerateResult, Sampling, TokenChunk

__all__ = ["Emit", "WorkerThreadEngine", "logsumexp", "sample_token"]

Emit = Callable[[Any], None]


def sample_token(logits: np.ndarray[Any, Any], sampling: Sampling, rng: np.random.Generator) -> tuple[int, float]:
    """Draw one token from ``logits`` under ``sampling``; returns ``(token, logprob under that distribution)``.

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


def logsumexp(z: np.ndarray[Any, Any]) -> float:
    m = float(np.max(z))
    return m + math.log(float(np.sum(np.exp(z - m))))


class WorkerThreadEngine:
    """The part of an in-process engine around its sampler: one worker thread every call runs on, in
    arrival order (the model is never entered twice at once), ``generate``, ``stream`` and closing.

    A subclass sets :attr:`label` and implements ``_generate_sync(prompt, sampling, emit, stop)``:
    it calls ``emit(TokenChunk)`` per sampled token when ``emit`` is given and ends at its next token
    once ``stop`` is set (the stream's consumer left: the agent disconnected).
    """

    #: How errors name the engine ("the llama.cpp engine is closed").
    label = "in-process"

    def __init__(self, *, thread_name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)
        self._closed = False

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
        result: GenerateResult = await self._run(self._generate_sync, list(prompt_ids), sampling, None, None)
        return result

    async def stream(self, prompt_ids: Sequence[int], sampling: Sampling) -> AsyncIterator[TokenChunk | GenerateResult]:
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
