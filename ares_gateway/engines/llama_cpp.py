"""In-process llama.cpp (``llama-cpp-python``) for CPU: the embedded default engine.

One model per engine, loaded once; every call runs in the engine's single worker thread, so the
event loop is never blocked and calls are serialized (llama.cpp contexts are not thread safe).

**Sampling and logprobs.** Sampling happens here, in numpy, from the logits llama.cpp computed:
temperature, then top-k, then top-p, renormalized; the token is drawn from that distribution
with a ``numpy`` generator seeded per call (a seed is drawn and recorded when none is given),
and its recorded logprob is its log-probability under exactly that distribution. At temperature
1.0 without top-k/top-p this is the model's log-softmax. ``temperature=0`` is greedy; its
recorded logprob is then the log-softmax at temperature 1.

**Batching.** On CPU, llama.cpp's logits for a position depend on how it was batched: a batch of
one token takes another kernel than a batch of two or more (differences up to ~1.8 in logits
were measured here), while batches of 2+ agree bit for bit. With ``consistent_batching`` (the
default) every evaluation has at least two tokens: each decode step re-evaluates the previous
token together with the new one (its cache entry is replaced by the same values a full pass
computes), and a prompt chunk is never a single token. The recorded logprobs then equal a
teacher-forced evaluation of the whole sequence in one batch, which is what a trainer computes.
The price is a second token per decode step (cheap for a memory-bound small model; measured in
``bench/bench_tito.py``).

**Prefix cache.** The KV cache of the previous call is kept; a prompt that extends it (the next
turn of the same session, built by :class:`~ares_gateway.tokens.TokenStreams`) only evaluates
its new tokens.

**Weight version.** The model file's weights never change in process; ``weight_version`` labels them
(the trainer step a GGUF was exported at, say), and every generation reports it
(``GenerateResult.weight_version``, the turn's policy version); :meth:`set_weight_version` relabels.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ares_gateway.engines._inprocess import WorkerThreadEngine, logsumexp, sample_token
from ares_gateway.engines.base import (
    EngineError,
    EngineUnavailableError,
    GenerateResult,
    PromptTooLongError,
    Sampling,
    TokenChunk,
)

__all__ = ["BUILD_HINT", "CMAKE_ARGS", "REBUILD_HINT", "LlamaCppEngine", "check_build", "sample_token"]

#: The build flags that work on CPUs where llama.cpp's native build crashes (AMX, see :func:`check_build`).
CMAKE_ARGS = "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
#: The command that installs a working llama-cpp-python.
BUILD_HINT = f"CMAKE_ARGS=\"{CMAKE_ARGS}\" python3 -m pip install --no-cache-dir 'llama-cpp-python>=0.3'"
#: The command that replaces a crashing build: without ``--no-cache-dir`` pip reuses the wheel it
#: cached for the sdist (its cache key ignores ``CMAKE_ARGS``), i.e. the crashing build again.
REBUILD_HINT = (
    f"CMAKE_ARGS=\"{CMAKE_ARGS}\" python3 -m pip install --no-cache-dir --force-reinstall --no-deps "
    "'llama-cpp-python>=0.3'"
)

# A llama.cpp built with GGML_NATIVE=ON on a CPU that reports AMX compiles its AMX backend in; on
# machines whose kernel does not grant AMX to the process (this one) the first matrix product
# segfaults in ggml_backend_amx_mul_mat, killing the whole process. So a build reporting AMX is
# probed once in a child process before the model is loaded here.
_PROBE = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=64, n_batch=8, n_ubatch=8, n_threads=1, verbose=False)
llm.eval([1, 2, 3, 4])
print("ok")
"""
_checked: dict[str, str | None] = {}


def check_build(model_path: str | None = None, *, timeout_s: float = 120.0) -> str:
    """Make sure the installed ``llama_cpp`` imports and will not crash this process; returns its
    system-info line.

    A build that compiled llama.cpp's AMX backend (``llama_print_system_info()`` lists ``AMX``) is
    probed once per process in a child that loads ``model_path`` (default: the embedded model) and
    evaluates a few tokens; a child killed by a signal means the build crashes here. Raises
    :class:`EngineUnavailableError` naming the command that installs (or rebuilds) a working one.
    """
    try:
        import llama_cpp
    except Exception as exc:  # ImportError, or a broken shared library's OSError
        raise EngineUnavailableError(
            f"llama-cpp-python is not installed (or failed to import: {exc}); install it with: {BUILD_HINT}"
        ) from exc
    lib = str(getattr(llama_cpp, "__file__", "llama_cpp"))
    if lib in _checked:
        if _checked[lib] is None:
            return _system_info(llama_cpp)
        raise EngineUnavailableError(str(_checked[lib]))
    info = _system_info(llama_cpp)
    problem = None
    if "AMX" in info.upper():
        problem = _probe(model_path, timeout_s)
    _checked[lib] = problem
    if problem is not None:
        raise EngineUnavailableError(problem)
    return info


def _system_info(llama_cpp: Any) -> str:
    try:
        raw = llama_cpp.llama_print_system_info()
    except Exception:
        return ""
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


def _probe(model_path: str | None, timeout_s: float) -> str | None:
    """``None`` when a child process can evaluate tokens with this build, else what went wrong."""
    import signal
    import subprocess
    import sys

    if model_path is None:
        from ares_gateway.tokens.tokenizer import default_model_path

        model_path = default_model_path()
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE, model_path], capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return ("the installed llama-cpp-python (built with AMX) did not evaluate 4 tokens within "
                f"{timeout_s:g} s in a probe process; rebuild it without the native CPU flags: "
                f"{REBUILD_HINT}")
    if proc.returncode == 0 and "ok" in proc.stdout:
        return None
    if proc.returncode < 0:
        try:
            how = f"killed by {signal.Signals(-proc.returncode).name}"
        except ValueError:
            how = f"killed by signal {-proc.returncode}"
    else:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
        how = f"exit status {proc.returncode}: {tail}"
    return (f"the installed llama-cpp-python crashes on this CPU (it was built with llama.cpp's AMX backend, "
            f"GGML_NATIVE=ON; a probe evaluating 4 tokens was {how}). Rebuild it without the native flags "
            f"(--no-cache-dir: pip's cached wheel ignores CMAKE_ARGS): {REBUILD_HINT}")


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    """Split ``range(n)`` into chunks of at most ``size`` tokens, none of a single token (when n >= 2)."""
    out: list[tuple[int, int]] = []
    i = 0
    while i < n:
        j = min(n, i + size)
        if n - j == 1:  # the last chunk would be a single token: move one token over to it
            j -= 1
        out.append((i, j))
        i = j
    return out


class LlamaCppEngine(WorkerThreadEngine):
    """A GGUF model run in process by llama.cpp.

    Args:
        model_path: the ``.gguf`` file; ``None``: the embedded SmolLM2-135M-Instruct.
        n_ctx: context window (tokens); ``None``: the model's trained context.
        n_threads: CPU threads (default: one less than the CPUs this process may use, at least 1, at most
            8: the agent, its sandbox and the gateway need a core; on 2 shared cores, 2 threads measured
            10-20x slower than 1, as llama.cpp's threads wait on each other whenever one is preempted).
        n_batch: prompt tokens evaluated per llama.cpp call.
        consistent_batching: never evaluate a single token alone (see the module docstring).
        load_timeout_s: how long loading the model may take before :class:`EngineUnavailableError`.
        weight_version: the label of the model's weights (``None``: unlabelled; the gateway's version
            then applies to its turns).
    """

    name = "llama-cpp"
    label = "llama.cpp"

    def __init__(
        self,
        model_path: str | None = None,
        *,
        n_ctx: int | None = None,
        n_threads: int | None = None,
        n_batch: int = 256,
        consistent_batching: bool = True,
        load_timeout_s: float = 120.0,
        weight_version: int | None = None,
    ) -> None:
        if model_path is None:
            from ares_gateway.tokens.tokenizer import default_model_path

            model_path = default_model_path()
        if not os.path.isfile(model_path):
            raise EngineUnavailableError(f"no model file at {model_path!r}")
        if n_batch < 2:
            raise ValueError(f"n_batch must be at least 2, got {n_batch}")
        self.model = model_path
        self.n_ctx_requested = n_ctx
        self._n_threads_requested = n_threads
        self.n_threads = n_threads or max(1, min(8, len(os.sched_getaffinity(0)) - 1))
        self.n_batch = n_batch
        self.consistent_batching = consistent_batching
        self.load_timeout_s = load_timeout_s
        super().__init__(thread_name="ares-llama", weight_version=weight_version)
        self._llm: Any = None
        self._cached: list[int] = []  # token ids whose KV entries the context holds, in order
        self.n_ctx = 0
        self.load_s = 0.0
        self.aborted_streams = 0  # calls whose consumer left before the end (sampling stopped early)

    def __reduce__(self) -> tuple[Any, ...]:
        # A copy sent to another process (a Ray actor on another node) is a fresh engine with the same
        # settings that loads its own model there: a loaded context and its worker thread cannot travel.
        return (_rebuild, (self.model, {"n_ctx": self.n_ctx_requested, "n_threads": self._n_threads_requested,
                                        "n_batch": self.n_batch,
                                        "consistent_batching": self.consistent_batching,
                                        "load_timeout_s": self.load_timeout_s,
                                        "weight_version": self.weight_version}))

    # ------------------------------------------------------------- lifecycle
    def _load(self) -> Any:
        if self._llm is None:
            check_build(self.model)  # a clear error instead of a segfault of the whole process
            from llama_cpp import Llama

            t0 = time.perf_counter()
            self._llm = Llama(
                model_path=self.model,
                n_ctx=self.n_ctx_requested or 0,
                n_batch=self.n_batch,
                n_ubatch=self.n_batch,
                n_threads=self.n_threads,
                n_threads_batch=self.n_threads,
                logits_all=False,
                verbose=False,
            )
            self.n_ctx = int(self._llm.n_ctx())
            self.load_s = time.perf_counter() - t0
        return self._llm

    async def load(self) -> None:
        """Load the model now (otherwise the first call does)."""
        await asyncio.wait_for(self._run(self._load), self.load_timeout_s)

    async def aclose(self) -> None:
        def _free() -> None:
            if self._llm is not None:
                self._llm.close()
                self._llm = None

        await self._close(_free)

    def _generate_sync(
        self,
        prompt: list[int],
        sampling: Sampling,
        emit: Callable[[Any], None] | None,
        stop: threading.Event | None,
    ) -> GenerateResult:
        import llama_cpp

        weight_version = self._reported_version()
        llm = self._load()
        ctx = llm._ctx
        n_ctx = self.n_ctx
        if not prompt:
            raise EngineError("an empty prompt: nothing to continue")
        if len(prompt) >= n_ctx:
            raise PromptTooLongError(len(prompt), n_ctx)
        max_new = min(sampling.max_tokens, n_ctx - len(prompt))
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        rng = np.random.default_rng(seed)
        vocab = int(llm.n_vocab())
        stop_ids = frozenset(sampling.stop_token_ids)

        def evaluate(tokens: list[int], start: int) -> np.ndarray[Any, Any]:
            """Evaluate tokens at positions start.. and return the last position's logits."""
            llm._batch.set_batch(batch=tokens, n_past=start, logits_all=False)
            ctx.decode(llm._batch)
            ptr = llama_cpp.llama_get_logits_ith(ctx.ctx, len(tokens) - 1)
            return np.ctypeslib.as_array(ptr, shape=(vocab,)).copy()

        # Reuse the cached prefix; evaluate at least two tokens (one with consistent_batching off).
        keep = 0
        for a, b in zip(self._cached, prompt, strict=False):
            if a != b:
                break
            keep += 1
        keep = max(0, min(keep, len(prompt) - (2 if self.consistent_batching else 1)))
        ctx.kv_cache_seq_rm(-1, keep, -1)
        self._cached = prompt[:keep]
        t0 = time.perf_counter()
        logits: np.ndarray[Any, Any] | None = None
        for i, j in _chunks(len(prompt) - keep, self.n_batch):
            logits = evaluate(prompt[keep + i : keep + j], keep + i)
        assert logits is not None
        self._cached = list(prompt)
        t1 = time.perf_counter()

        out: list[int] = []
        lps: list[float] = []
        finish: Any = "length"
        while True:
            tok, lp = sample_token(logits, sampling, rng)
            out.append(tok)
            lps.append(lp)
            if emit is not None:
                emit(TokenChunk([tok], [lp]))
            if tok in stop_ids:
                finish = "stop"
                break
            if len(out) >= max_new:
                break
            if stop is not None and stop.is_set():
                self.aborted_streams += 1
                break
            pos = len(self._cached)
            if self.consistent_batching:
                # Re-evaluate the previous token with the new one: a batch of two, like a full pass.
                ctx.kv_cache_seq_rm(-1, pos - 1, -1)
                logits = evaluate([self._cached[-1], tok], pos - 1)
            else:
                logits = evaluate([tok], pos)
            self._cached.append(tok)
        t2 = time.perf_counter()
        return GenerateResult(
            output_ids=out,
            logprobs=lps,
            finish_reason=finish,
            prompt_tokens=len(prompt),
            cached_tokens=keep,
            prefill_s=t1 - t0,
            decode_s=t2 - t1,
            extra={"seed": seed, "consistent_batching": self.consistent_batching},
            weight_version=weight_version,
        )

    # ------------------------------------------------------------ evaluation
    async def score(self, token_ids: Sequence[int], start: int, *, batch: int | None = None) -> list[float]:
        """Log-softmax logprob of ``token_ids[k]`` given ``token_ids[:k]`` for ``k >= start``: a
        teacher-forced pass.

        Independent of any generation: it clears the cache and evaluates the sequence in chunks of
        ``batch`` tokens (default ``n_batch``; never a single token), recording all positions' logits.
        Used to check recorded logprobs and by trainers' parity tests.
        """
        ids = list(token_ids)
        if not 1 <= start < len(ids):
            raise ValueError(f"start must be in [1, {len(ids)}), got {start}")
        return list(await self._run(self._score_sync, ids, start, batch or self.n_batch))

    def _score_sync(self, ids: list[int], start: int, batch: int) -> list[float]:
        import llama_cpp

        llm = self._load()
        ctx = llm._ctx
        if len(ids) > self.n_ctx:
            raise PromptTooLongError(len(ids), self.n_ctx)
        vocab = int(llm.n_vocab())
        ctx.kv_cache_seq_rm(-1, 0, -1)
        self._cached = []
        out: list[float] = []
        for i, j in _chunks(len(ids), min(batch, self.n_batch)):
            toks = ids[i:j]
            b = llm._batch
            b.set_batch(batch=toks, n_past=i, logits_all=True)
            ctx.decode(b)
            for r in range(j - i):
                k = i + r + 1  # this row predicts ids[k]
                if k < start or k >= len(ids):
                    continue
                row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx.ctx, r), shape=(vocab,))
                x = row.astype(np.float64)
                out.append(float(x[ids[k]] - logsumexp(x)))
        self._cached = list(ids)
        return out


def _rebuild(model_path: str, options: dict[str, Any]) -> LlamaCppEngine:
    """:meth:`LlamaCppEngine.__reduce__`'s other half."""
    return LlamaCppEngine(model_path, **options)
