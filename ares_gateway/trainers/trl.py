"""TRL's ``GRPOTrainer``: each completion is one real agent episode, sampled by the model being trained.

::

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from ares_gateway.trainers.trl import reward_from_episode, rollout_func

    rollouts = rollout_func("examples", harness="mini-swe-agent", sandbox="local", step_limit=8)
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[reward_from_episode],
                          train_dataset=Dataset.from_dict({"prompt": ["fix-median-bug", ...]}),
                          args=GRPOConfig(num_generations=2, ...), rollout_func=rollouts)
    trainer.train()

**The contract.** TRL calls ``rollouts(prompts, trainer)`` once per generation batch with the batch's
prompts (each already repeated ``num_generations`` times by its sampler). Each prompt names a task of
the dataset (a string, or chat messages whose last content is the name); each entry runs one
episode: the harness CLI in a fresh sandbox, every LLM call it makes rendered by the gateway and
sampled token-in/token-out from ``trainer.model`` itself (:class:`~ares_gateway.engines.transformers.TransformersEngine`,
no copy: step N+1's episodes sample the weights step N produced), rewarded by the task's verifier.

Per entry it returns what TRL wants: ``prompt_ids`` (the first turn's prompt), ``completion_ids``
(everything after it: the model's answers and, between them, the agent's tool outputs and the next
turns' headers), ``logprobs`` (the sampler's, 0.0 where not sampled), ``env_mask`` (1 on tokens the model
sampled, 0 on every tool output / observation token), and as extra keys the episode's ``reward``,
``task``, ``session_id``, ``exit_reason``, ``turns``, ``error``, ``other_samples``, ``foreign_samples``, ``sampled_tokens`` and
``mean_logprob`` (over the sampled tokens) and ``truncated`` (the completion was cut to
``max_completion_tokens``), which TRL passes to the reward functions (it keeps
``logprobs`` and ``env_mask`` from them); :func:`reward_from_episode` returns the verifier's reward and logs the facts as
TRL completion-table columns.

**One sample an episode.** An episode's turns can give several samples (the agent rewrote its
history, made side calls, or one of its tool commands sent requests with the session's credentials);
TRL gets the main line, the harness CLI's own conversation (:func:`~ares_gateway.trainers.main_sample`),
the count of the others is ``other_samples``, of them the foreign ones (conversations that do not
extend the session's first request) ``foreign_samples``.

**On a Ray cluster** (``rollout_func(..., executor=RayExecutor(per_node=4))``): the episodes run on the
cluster's nodes, their turns are still sampled here, by ``trainer.model``: the engine is served over
HTTP (:class:`~ares_gateway.engines.server.EngineServer`, SGLang's ``/generate``, on ``engine_host``) and
each node's gateway gets a :class:`~ares_gateway.trainers._served.RemoteTitoPolicy` over it (same
tokenizer, renderer and sampling). The batch is the local path's, entry for entry.

**A failed episode** (the agent or its install failed, the
sandbox did not start, the engine failed) is an entry with reward 0, its error, and a one-token
completion that is masked out (``env_mask`` 0), so the training step goes on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ares_gateway.trainers._common import (
    EpisodeSample,
    TrainerError,
    describe_failure,
    play_episodes,
    require,
    resolve_dataset,
    resolve_tasks,
)

if TYPE_CHECKING:
    from ares_gateway.episodes.executor import Executor
    from ares_gateway.trainers._served import ServedEngine

log = logging.getLogger(__name__)

__all__ = ["EPISODE_KEYS", "AresRollouts", "TokenizerMismatchError", "reward_from_episode", "rollout_func"]

T = TypeVar("T")

#: The extra keys each rollout returns per completion (TRL hands them to the reward functions).
EPISODE_KEYS = ("reward", "task", "session_id", "exit_reason", "turns", "error", "other_samples",
                "foreign_samples", "sampled_tokens", "mean_logprob", "truncated")

#: Texts whose ids must be the same under the trainer's tokenizer and the gateway's.
_PROBE_TEXTS = (
    "def median(xs):\n    xs = sorted(xs)\n    return xs[len(xs) // 2]  # 3.14 é ü 中文 🙂\n",
    "<|im_start|>user\nFix the bug in `slug.py`, then run `pytest -q`.<|im_end|>\n<|im_start|>assistant\n",
    "THOUGHT: ls -la /tmp && cat README.md | head -n 20\n\n```bash\necho 'done'\n```",
)


class TokenizerMismatchError(TrainerError):
    """The trainer's tokenizer and the one the gateway renders with give different ids; the samples
    would not be the sequences the trainer scores."""


class _Loop:
    """One event loop (uvloop where installed, as the CLI runs) on a thread of its own: TRL calls the
    rollout function synchronously, the gateway and the sandboxes live across its calls."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop
        try:
            import uvloop

            self.loop = uvloop.new_event_loop()
        except ImportError:
            self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="ares-trl-rollouts", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result()
        except BaseException:
            # Interrupted (Ctrl-C in the trainer): cancel the episodes, each removes its sandbox.
            fut.cancel()
            raise

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)
        if not self.loop.is_running():
            self.loop.close()


class AresRollouts:
    """The callable :func:`rollout_func` returns; see the module docstring for what it does.

    Attributes:
        last_episodes: the latest call's :class:`~ares_gateway.trainers.EpisodeSample` list, in prompt order.
        calls: one dict per call: ``seconds`` (the call's wall time), ``generation_s`` (the engine's
            busy time), ``episodes``, ``failed``, ``mean_reward``.
    """

    def __init__(self, dataset: Any, *, harness: str, sandbox: str, step_limit: int | None, time_limit: float | None,
                 concurrency: int, tokenizer: str | None, renderer: str | None, sampling: Mapping[str, Any],
                 harness_options: Mapping[str, Any] | None, out: str | None, check_tokenizer: bool,
                 max_completion_tokens: int | None = None, executor: Executor | None = None,
                 engine_host: str = "127.0.0.1", engine_port: int = 0,
                 engine_server_options: Mapping[str, Any] | None = None) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        if max_completion_tokens is not None and max_completion_tokens < 1:
            raise ValueError(f"max_completion_tokens must be at least 1 (or None: no cap), got {max_completion_tokens}")
        self.max_completion_tokens = max_completion_tokens
        self.dataset = resolve_dataset(dataset)
        self.harness = harness
        self.sandbox = sandbox
        self.step_limit = step_limit
        self.time_limit = time_limit
        self.concurrency = concurrency
        self.tokenizer = tokenizer
        self.renderer_name = renderer
        self.sampling = dict(sampling)
        self.harness_options = dict(harness_options or {})
        self.out = out
        self.check_tokenizer = check_tokenizer
        self.executor = executor
        # Episodes in other processes reach the engine over HTTP (served at the first call).
        self.served: ServedEngine | None = None
        if executor is not None and executor.kind != "local":
            from ares_gateway.trainers._served import ServedEngine

            self.served = ServedEngine(host=engine_host, port=engine_port, server_options=engine_server_options)
        self.last_episodes: list[EpisodeSample] = []
        self.calls: list[dict[str, Any]] = []
        self.policy: Any = None
        self.engine: Any = None
        self._model_id: int | None = None
        self._loop: _Loop | None = None
        self._lock = threading.Lock()
        from sandbox import janitor

        janitor.install()  # from the trainer's (main) thread: Ctrl-C removes the episodes' sandboxes

    # ----------------------------------------------------------------- TRL
    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        """TRL's ``rollout_func(prompts, trainer)``: one episode per prompt, TRL's dict of lists back."""
        with self._lock:
            t0 = time.perf_counter()
            tasks = resolve_tasks(self.dataset, prompts)
            policy = self._policy_for(trainer)
            # The trainer updated the weights since the last call (a fused optimizer leaves no trace the
            # engine could see): no KV cache of the old weights may be reused.
            self.engine.reset()
            busy0 = self.engine.busy_s
            if self._loop is None:
                self._loop = _Loop()
            options = {**policy.harness_options(self.harness), **self.harness_options}
            step = getattr(getattr(trainer, "state", None), "global_step", None)
            out = f"{self.out}/step-{step}" if self.out and step is not None else self.out
            episode_policy: Any = policy
            if self.served is not None:
                source = self.tokenizer or _default_tokenizer()
                episode_policy = self._loop.run(self.served.policy_for(
                    self.engine, tokenizer=source, renderer=self.renderer_name, sampling=self.sampling))
            episodes = self._loop.run(play_episodes(
                tasks, harness=self.harness, policy=episode_policy, sandbox=self.sandbox, concurrency=self.concurrency,
                step_limit=self.step_limit, time_limit=self.time_limit, harness_options=options, out=out,
                executor=self.executor,
            ))
            self.last_episodes = episodes
            batch = self._batch(episodes, prompts, trainer)
            failed = [e for e in episodes if e.sample is None]
            for e in failed:
                log.warning("episode without a sample (reward 0): %s", describe_failure(e))
            self.calls.append({
                "step": step, "seconds": time.perf_counter() - t0, "generation_s": self.engine.busy_s - busy0,
                "episodes": len(episodes), "failed": len(failed),
                "mean_reward": sum(e.reward for e in episodes) / max(1, len(episodes)),
            })
            return batch

    def close(self) -> None:
        """Stop the rollouts' event loop (the episodes' sandboxes are already gone)."""
        if self._loop is not None:
            if self.served is not None:
                self._loop.run(self.served.aclose())
            if self.policy is not None:
                self._loop.run(self.policy.aclose())
            self._loop.close()
            self._loop = None

    # ----------------------------------------------------------- internals
    def _policy_for(self, trainer: Any) -> Any:
        model = trainer.model
        accelerator = getattr(trainer, "accelerator", None)
        if accelerator is not None:
            model = accelerator.unwrap_model(model)
        if self.policy is not None and self._model_id == id(model):
            return self.policy
        from ares_gateway.engines.transformers import TransformersEngine
        from ares_gateway.policies.tito import TitoPolicy

        source = self.tokenizer or _default_tokenizer()
        self.engine = TransformersEngine(model)
        self.policy = TitoPolicy(self.engine, tokenizer=source, renderer=self.renderer_name, **self.sampling)
        self._model_id = id(model)
        if self.check_tokenizer:
            self._check_tokenizer(getattr(trainer, "processing_class", None), source)
        return self.policy

    def _check_tokenizer(self, theirs: Any, source: str) -> None:
        if theirs is None or not hasattr(theirs, "encode"):
            return
        ours = self.policy.renderer.tokenizer
        for text in _PROBE_TEXTS:
            a = list(ours.encode(text))
            b = list(theirs.encode(text, add_special_tokens=False))
            if a != b:
                raise TokenizerMismatchError(
                    f"the trainer's tokenizer and the gateway's ({source}) give different ids for {text[:40]!r} "
                    f"({b[:12]}... vs {a[:12]}...): pass rollout_func(tokenizer=...) the model's own .gguf file or "
                    "Hugging Face folder"
                )

    def _batch(self, episodes: Sequence[EpisodeSample], prompts: Sequence[Any], trainer: Any) -> dict[str, list[Any]]:
        tok = getattr(trainer, "processing_class", None)
        eos = getattr(tok, "eos_token_id", None)
        if eos is None:
            eos = self.policy.renderer.tokenizer.eos_token_id or 0
        batch: dict[str, list[Any]] = {k: [] for k in ("prompt_ids", "completion_ids", "logprobs", "env_mask",
                                                        *EPISODE_KEYS)}
        for e in episodes:
            s = e.sample
            if s is not None and s.response_length > 0:
                n = s.prompt_length
                tokens = s.tokens.tolist()
                # TRL trains on what it is given, whole: a long episode is cut here, not by an out-of-memory.
                cut = self.max_completion_tokens or s.response_length
                batch["prompt_ids"].append(tokens[:n])
                batch["completion_ids"].append(tokens[n:][:cut])
                batch["logprobs"].append([float(x) for x in s.logprobs.tolist()][:cut])
                mask = [int(x) for x in s.loss_mask.tolist()][:cut]
                batch["env_mask"].append(mask)
                batch["truncated"].append(s.response_length > cut)
                picked = [lp for lp, m in zip(batch["logprobs"][-1], mask, strict=True) if m]
                batch["sampled_tokens"].append(len(picked))
                batch["mean_logprob"].append(sum(picked) / len(picked) if picked else 0.0)
            else:
                # Nothing sampled: a masked one-token completion keeps TRL's batch shape; reward 0.
                ids = self.policy.renderer.tokenizer.encode(e.task) or [int(eos)]
                batch["prompt_ids"].append(ids)
                batch["completion_ids"].append([int(eos)])
                batch["logprobs"].append([0.0])
                batch["env_mask"].append([0])
                batch["sampled_tokens"].append(0)
                batch["mean_logprob"].append(0.0)
                batch["truncated"].append(False)
                if e.error is None:
                    e.error = "the episode recorded no model turn"
                e.reward = 0.0
            for k, v in e.facts().items():
                batch[k].append(v)
        return batch


def _default_tokenizer() -> str:
    from ares_gateway.tokens.tokenizer import default_model_path

    return default_model_path()


def rollout_func(
    dataset: Any,
    *,
    harness: str = "mini-swe-agent",
    sandbox: str = "local",
    step_limit: int | None = 20,
    time_limit: float | None = None,
    concurrency: int = 4,
    tokenizer: str | None = None,
    renderer: str | None = None,
    max_tokens: int = 512,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    harness_options: Mapping[str, Any] | None = None,
    out: str | None = None,
    check_tokenizer: bool = True,
    max_completion_tokens: int | None = None,
    executor: Executor | None = None,
    engine_host: str = "127.0.0.1",
    engine_port: int = 0,
    engine_server_options: Mapping[str, Any] | None = None,
) -> AresRollouts:
    """A ``rollout_func`` for TRL's ``GRPOTrainer`` (see the module docstring).

    Args:
        dataset: the task dataset the prompts name (a registered name such as ``"examples"``, a folder, or
            a :class:`~ares_gateway.episodes.tasks.Dataset`); an empty one is an error.
        harness / sandbox: the agent CLI and the sandbox backend of every episode.
        step_limit / time_limit: per-episode bounds (LLM calls; seconds, default: the task's).
        concurrency: episodes at once.
        tokenizer: the model's ``.gguf`` file or Hugging Face folder the gateway renders with (default:
            the embedded SmolLM2 GGUF); checked against ``trainer.processing_class`` on the first call.
        renderer: a ``renderers`` name (default: by model name, else the model's chat template).
        max_tokens / temperature / top_p / top_k / seed: sampling of each turn. Keep ``temperature=1.0``
            and no top-k/top-p for the logprobs to be the model's own (what GRPO's ratio assumes).
        harness_options: more harness options (mini-swe-agent gets ``action_format="text"`` by itself for
            a model without a tool-call format).
        out: a folder to write each call's run files to (``out/step-N/``: results.json, trajectories, logs).
        check_tokenizer: refuse a trainer whose tokenizer gives other ids than the gateway's.
        max_completion_tokens: cut each completion (ids, logprobs, mask) to this many tokens (``None``: whole
            episodes; TRL does not cut what a rollout function returns). A cut entry has ``truncated`` True.
        executor: where the episodes run (default: this process). One whose ``kind`` is not ``"local"``
            (:class:`~ares_gateway.episodes.ray.RayExecutor`) runs them elsewhere: the engine is then served
            over HTTP and the executor's workers sample ``trainer.model`` through it. ``concurrency`` still
            caps the episodes at once (give it nodes x ``per_node``).
        engine_host / engine_port: where the engine is served for such an executor (default: 127.0.0.1, a
            free port). On a real cluster give the trainer machine's address that the nodes reach.
        engine_server_options: more :class:`~ares_gateway.engines.server.EngineServer` options (its limits).
    """
    require("torch", "trl")
    require("transformers", "trl")
    return AresRollouts(
        dataset, harness=harness, sandbox=sandbox, step_limit=step_limit, time_limit=time_limit,
        concurrency=concurrency, tokenizer=tokenizer, renderer=renderer,
        sampling={"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed},
        harness_options=harness_options, out=out, check_tokenizer=check_tokenizer,
        max_completion_tokens=max_completion_tokens, executor=executor, engine_host=engine_host,
        engine_port=engine_port, engine_server_options=engine_server_options,
    )


def reward_from_episode(completions: Sequence[Any] | None = None, *, reward: Sequence[float] | None = None,
                        log_extra: Callable[[str, list[Any]], None] | None = None, **facts: Any) -> list[float]:
    """A TRL reward function: each completion's episode reward (the task verifier's), as the rollout
    returned it. Logs ``task``, ``session_id``, ``exit_reason``, ``turns``, ``error``, ``other_samples`` and
    ``foreign_samples`` as completion-table columns."""
    if reward is None:
        raise TrainerError("reward_from_episode needs the rollout's 'reward' column: use it with "
                           "ares_gateway.trainers.trl.rollout_func")
    if log_extra is not None:
        for key in ("task", "session_id", "exit_reason", "turns", "error", "other_samples", "foreign_samples"):
            if key in facts:
                log_extra(key, list(facts[key]))
    return [float(r) for r in reward]
