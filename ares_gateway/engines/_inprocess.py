"""What the in-process engines (llama.cpp, transformers) share: sampling one token from logits, and
streaming the tokens a worker thread samples to the event loop."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ares_gateway.engines.base import GenerateResult, Sampling, TokenChunk

__all__ = ["logsumexp", "sample_token", "thread_stream"]

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
    z = x / sampling.temperature
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


async def thread_stream(
    pool: ThreadPoolExecutor, work: Callable[[Emit, threading.Event], GenerateResult]
) -> AsyncGenerator[TokenChunk | GenerateResult, None]:
    """Run ``work(emit, stop)`` on ``pool`` and yield what it emits, then its result.

    ``work`` calls ``emit(TokenChunk)`` per sampled token from its thread; when the consumer leaves
    early (the agent disconnected) ``stop`` is set and ``work`` should end at its next token. The
    worker's exception is raised here.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[TokenChunk | GenerateResult | BaseException] = asyncio.Queue()
    stop = threading.Event()

    def emit(item: TokenChunk | GenerateResult | BaseException) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, item)

    def run() -> None:
        try:
            emit(work(emit, stop))
        except BaseException as exc:  # handed to the consumer, raised there
            emit(exc)

    fut = loop.run_in_executor(pool, run)  # starts now, not when awaited
    try:
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if isinstance(item, GenerateResult):
                return
    finally:
        stop.set()
        await asyncio.shield(fut)
