"""TRL's AsyncGRPO harness path on real agent episodes on CPU: one optimizer step, split by where its time
goes.

    python3 bench/bench_async_grpo.py [--steps 4] [--step-limit 2] [--max-tokens 32] [--num-generations 2]

A real ``AsyncGRPOTrainer`` (TRL, CPU, fp32) trains SmolLM2-135M-Instruct on rollouts its own harness rollout
loop (``trl.experimental.async_grpo.openenv_harness._HarnessRolloutLoop``) plays through
:class:`ares_gateway.trainers.openenv.AresSessionFactory`: each rollout one real mini-swe-agent episode in a
local sandbox, every turn rendered by the gateway and sampled token-in/token-out. The trainer consumes the
packed rows from the loop's queue while the next episodes run (the path's point: rollouts and training
overlap), syncs the weights to the sampler after every step, and drops samples staler than
``max_staleness``.

What cannot run on this machine, and its stand-in here (everything else is TRL's and the project's own code):

* **TRL's vLLM server** (GPU): a :class:`~ares_gateway.engines.TransformersEngine` over a second copy of the
  model in this process samples the sessions' turns, as ``VLLMEngine(url=<TRL's server>)`` would in training.
* **The NCCL weight transfer** (TRL's ``WeightTransferClient``): :class:`_CopyTransfer`, injected through
  ``AsyncGRPOTrainer(weight_transfer=...)``: ``pause`` holds the sampler's worker thread once its running
  call is done (vLLM's pause), ``send_weights`` copies each parameter TRL streams into the sampler's copy,
  ``resume`` labels the sampler's weights with TRL's model version and releases it.
* **The worker's spawned process** (``HarnessRolloutWorker``): :class:`_ThreadWorker` runs TRL's own harness
  rollout loop in a thread of this process (the sampler object must be the one the sessions use), with the
  queues the trainer reads.
* TRL's MFU metric asks CUDA for the device's name: it reports none here.
* **flash-attn 3's varlen kernel** (TRL's tree attention, GPU only): :func:`_varlen_attention`, torch's
  ``scaled_dot_product_attention`` over each packed segment, causal aligned to the segment's end as
  flash-attn's is.

Per optimizer step (after the first, which starts the loop and warms everything):

* **step**: TRL's ``perf/step_s`` (end of the previous step to the end of this one);
* **rollout wait**: ``perf/rollout_wait_s``, what the trainer sat waiting for samples (the episodes' time not
  hidden behind training);
* **training**: ``perf/fwd_bwd_s`` + ``perf/optimizer_s``;
* **weight sync**: ``perf/weight_sync_s`` (pause, copy, resume);
* **generation**: the sampler's busy time in the step (prefill + decode), overlapped with training;
* **gateway's own time**: an upper bound: the CPU time of the sessions' event-loop thread (HTTP handling,
  parsing, answers, recording, and the sandbox plumbing that shares the loop) plus the prompt rendering.

Figures are medians over the steps (2 shared cores: the sampler and the trainer share them, so overlap here
costs what it saves; on a GPU machine they are different devices).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ares_gateway import EpisodeConfig, RunConfig
from bench.support.render_clock import RenderClock

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

TASKS = ["fix-median-bug", "write-greeting-file"]
# Every answer runs as a command, one that waits cut after a few seconds: each episode has all its turns.
MINI = {"action_regex": r"\A(.+)\Z", "command_timeout": 5}


def _varlen_attention(q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, _max_q: Any, _max_k: Any, *,
                      softmax_scale: float | None = None, causal: bool = True, window_size: Any = (-1, -1),
                      **_: Any) -> Any:
    """flash-attn's ``flash_attn_varlen_func`` on CPU: per packed segment, SDPA with the causal mask aligned
    to the segment's last key (flash-attn's rule when a segment has fewer queries than keys)."""
    import torch
    import torch.nn.functional as F

    if window_size not in ((-1, -1), [-1, -1]):
        raise NotImplementedError("sliding-window attention: SmolLM2 has none")
    out = q.new_empty(q.shape)
    heads, kv_heads = q.shape[1], k.shape[1]
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        if qe == qs:
            continue
        qi = q[qs:qe].transpose(0, 1)  # (H, Lq, D)
        ki = k[ks:ke].transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
        vi = v[ks:ke].transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
        lq, lk = qe - qs, ke - ks
        mask = None
        if causal:
            mask = (torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq))
        out[qs:qe] = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask,
                                                    scale=softmax_scale).transpose(0, 1)
    return out


class _CopyTransfer:
    """TRL's ``WeightTransferProtocol`` for a sampler in this process: pause it, copy, label, resume."""

    def __init__(self, engine: Any, trainer_version: Any) -> None:
        self.engine = engine
        self.version = trainer_version  # returns TRL's model version after the sync
        self.params = dict(engine.module.named_parameters())
        self._release = threading.Event()
        self._held = threading.Event()
        self.copied = 0

    def init_weight_transfer(self) -> None:
        pass

    def pause(self) -> None:
        def hold() -> None:
            self._held.set()
            self._release.wait()

        self._release.clear()
        self._held.clear()
        self.engine._pool.submit(hold)  # queued behind the running call: the sampler is idle once held
        self._held.wait()

    def send_weights(self, iterator: Any) -> None:
        import torch

        with torch.no_grad():
            for name, tensor in iterator:
                self.params[name].copy_(tensor)
                self.copied += 1

    def resume(self) -> None:
        self.engine.reset()  # the copy_ above advanced the version counters: drop caches, then label
        self.engine.set_weight_version(self.version() + 1)  # TRL bumps its version right after resume
        self._release.set()

    def destroy(self) -> None:
        self._release.set()


class _ThreadWorker:
    """TRL's ``RolloutWorkerProtocol``: its harness rollout loop in a thread of this process."""

    def __init__(self, **loop_kwargs: Any) -> None:
        self.rollout_buffer: queue.Queue[Any] = queue.Queue(maxsize=int(loop_kwargs.get("queue_maxsize", 0)))
        self.metrics_queue: queue.Queue[Any] = queue.Queue(maxsize=4096)
        self._version = mp.Value("i", 0)
        self._heartbeat = mp.Value("d", 0.0)
        self._failed = threading.Event()
        self._errors: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._kwargs = loop_kwargs
        self._loop: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        from accelerate.state import PartialState
        from trl.experimental.async_grpo.openenv_harness import _HarnessRolloutLoop

        PartialState()
        self._heartbeat.value = time.time()
        self._loop = _HarnessRolloutLoop(
            **self._kwargs, rollout_buffer=self.rollout_buffer, model_version_value=self._version,
            heartbeat_value=self._heartbeat, failed_event=self._failed, exception_info_queue=self._errors,
            metrics_queue=self.metrics_queue)
        self._thread = threading.Thread(target=self._loop.run, name="harness-rollout-loop", daemon=True)
        self._thread.start()

    def update_model_version(self, model_version: int) -> None:
        with self._version.get_lock():
            self._version.value = int(model_version)

    def check_health(self, stale_after_s: float) -> None:
        if self._failed.is_set():
            cause = self._errors.queue[0] if self._errors.qsize() else ""
            raise RuntimeError(f"the rollout loop failed: {cause}")
        if time.time() - self._heartbeat.value > stale_after_s:
            raise RuntimeError("the rollout loop's heartbeat is stale")

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop._loop.call_soon_threadsafe(self._loop._stop_event.set)
            self._thread.join(timeout=300)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer, async_grpo_trainer, packing

    from ares_gateway.engines import TransformersEngine
    from ares_gateway.tokens.tokenizer import default_model_path
    from ares_gateway.trainers.openenv import AresSessionFactory

    torch.manual_seed(args.seed)
    folder, name = os.path.split(default_model_path())
    packing._flash_attn = lambda: argparse.Namespace(flash_attn_varlen_func=_varlen_attention)
    # The MFU metric asks CUDA for the device's name; on CPU there is none to report.
    async_grpo_trainer.get_peak_flops_per_device = lambda *a, **k: None
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # SmolLM2's template is none TRL knows a response schema for; the loop-owning path never parses with it.
    tokenizer.response_schema = {
        "type": "object", "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}}}
    # The GGUF dequantized once into a Hugging Face folder: the trainer loads its model by path, and a model
    # loaded from GGUF counts as quantized to transformers' Trainer (which then refuses to train it).
    hf = os.path.join(tempfile.mkdtemp(prefix="bench-async-grpo-model-"), "smollm2")
    sampler = TransformersEngine.from_pretrained(folder, gguf_file=name, weight_version=0)
    sampler.module.save_pretrained(hf)
    tokenizer.save_pretrained(hf)

    render = RenderClock()  # the tito policy's prompt rendering, in worker threads
    out = tempfile.mkdtemp(prefix="bench-async-grpo-")
    factories: list[AresSessionFactory] = []

    def factory(**kwargs: Any) -> AresSessionFactory:
        f = AresSessionFactory(
            "examples", engine=sampler, max_tokens=args.max_tokens,
            episode=EpisodeConfig("mini-swe-agent", harness_options=MINI, sandbox="local",
                                  step_limit=args.step_limit),
            run=RunConfig(out=os.path.join(out, "episodes")), **kwargs,
        )
        factories.append(f)
        return f

    cfg = AsyncGRPOConfig(
        output_dir=os.path.join(out, "trainer"), max_steps=args.steps + 1, learning_rate=1e-5,
        num_generations=args.num_generations, max_completion_length=args.max_tokens, temperature=1.0,
        per_device_train_batch_size=args.num_generations, gradient_accumulation_steps=1,
        token_budget=0,  # a fixed count a step: one group (a token budget packs many: they share the prompt)
        max_inflight_tasks=args.num_generations, queue_maxsize=args.queue_maxsize, weight_sync_steps=1,
        max_staleness=args.max_staleness,
        use_cpu=True, bf16=False, dtype="float32", logging_steps=1, report_to=[], save_strategy="no",
        disable_tqdm=True, seed=args.seed,
        heartbeat_stale_after_s=3600.0,
    )
    worker = _ThreadWorker(
        harness_session_factory=factory, model_name="smollm2-135m",
        dataset=Dataset.from_dict({"prompt": TASKS}), reward_funcs=[], processing_class=tokenizer,
        eos_token_ids=[tokenizer.eos_token_id], num_generations=args.num_generations,
        max_inflight_tasks=args.num_generations, max_tokens=args.max_tokens, temperature=1.0,
        queue_maxsize=args.queue_maxsize, score_queue_maxsize=1,  # generation runs at most a group ahead
    )
    holder: dict[str, Any] = {}
    started = time.perf_counter()
    transfer = _CopyTransfer(sampler, lambda: holder["trainer"].model_version)
    marks: list[dict[str, float]] = []

    def loop_cpu() -> float:
        fs = factories[0] if factories else None
        if fs is None:
            return 0.0

        async def cpu() -> float:
            return time.thread_time()

        return float(fs._loop.submit(cpu()).result(timeout=60))

    class Marks(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, *a: Any, **k: Any) -> None:
            marks.append({"t": time.perf_counter(), "busy": sampler.busy_s, "loop_cpu": loop_cpu(),
                          "render": render.seconds, "calls": float(sampler.calls)})
            print(f"  step {len(marks)} at {marks[-1]['t'] - started:.0f} s", file=sys.stderr, flush=True)

    trainer = AsyncGRPOTrainer(model=hf, args=cfg, train_dataset=Dataset.from_dict({"prompt": TASKS}),
                               processing_class=tokenizer, rollout_worker=worker, weight_transfer=transfer,
                               callbacks=[Marks()])
    holder["trainer"] = trainer
    try:
        trainer.train()
    finally:
        for f in factories:
            f.close()
        render.close()
    wall = time.perf_counter() - started
    logs = [h for h in trainer.state.log_history if "perf/fwd_bwd_s" in h]
    rows = []
    for i in range(1, min(len(logs), len(marks))):
        h, m0, m1 = logs[i], marks[i - 1], marks[i]
        step_s = h.get("perf/step_s") or (m1["t"] - m0["t"])
        gateway = (m1["loop_cpu"] - m0["loop_cpu"]) + (m1["render"] - m0["render"])
        rows.append({
            "step_s": step_s, "rollout_wait_s": h.get("perf/rollout_wait_s") or 0.0,
            "training_s": (h.get("perf/fwd_bwd_s") or 0.0) + (h.get("perf/optimizer_s") or 0.0),
            "weight_sync_s": h.get("perf/weight_sync_s") or 0.0,
            "generation_s": m1["busy"] - m0["busy"], "gateway_own_s": gateway,
            "gateway_share": gateway / step_s, "calls": m1["calls"] - m0["calls"],
            "samples": h.get("batch/samples_per_step") or 0.0,
            "trained_tokens": h.get("batch/trained_tokens_per_step") or 0.0,
            "staleness_mean": h.get("sample/staleness_mean") or 0.0,
        })
    if not rows:
        raise SystemExit(f"no step after the first was logged ({len(logs)} logged): raise --steps")
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return {"median": med, "steps": rows, "wall_s": wall, "weights_copied": transfer.copied, "out": out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps after the first")
    ap.add_argument("--step-limit", type=int, default=2, help="LLM calls per episode")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--num-generations", type=int, default=2, help="episodes per group")
    ap.add_argument("--max-staleness", type=int, default=2)
    ap.add_argument("--queue-maxsize", type=int, default=4,
                    help="scored samples the loop may queue ahead of the trainer (back-pressure)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    result = measure(args)
    if args.json:
        print(json.dumps({"settings": vars(args), **result}, indent=2))
        return 0
    med = result["median"]
    print(f"AsyncGRPO step on real episodes (CPU): {len(result['steps'])} steps after the first, "
          f"{args.num_generations} episodes a group, step_limit {args.step_limit}, "
          f"max_tokens {args.max_tokens}; wall {result['wall_s']:.0f} s")
    for key, label in [("step_s", "step"), ("rollout_wait_s", "  waiting for rollouts"),
                       ("training_s", "  training (forward, backward, optimizer)"),
                       ("weight_sync_s", "  weight sync (pause, copy, resume)"),
                       ("generation_s", "generation (sampler busy, overlapped)"),
                       ("gateway_own_s", "gateway's own time (upper bound)")]:
        print(f"{label:<45} {med[key]:8.2f} s  {med[key] / med['step_s']:6.1%}")
    print(f"{med['calls']:.0f} LLM calls, {med['samples']:.0f} samples, {med['trained_tokens']:.0f} trained "
          f"tokens, mean staleness {med['staleness_mean']:.2f} a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
