"""One GRPO step of TRL on real agent episodes, split by where its time goes.

    python3 bench/bench_training.py [--steps 3] [--step-limit 3] [--max-tokens 64] [--concurrency 2] [--json]
    python3 bench/bench_training.py --overlap ...   # rollout_func(overlap=True)
    python3 bench/bench_training.py --compare ...   # both, on the same settings: medians and their ratio

A real ``GRPOTrainer`` (TRL, CPU, fp32) trains SmolLM2-135M-Instruct (the embedded GGUF, dequantized)
with :func:`ares_gateway.trainers.trl.rollout_func`: each step is one group of ``num_generations=2``
real mini-swe-agent episodes in local sandboxes, sampled from the model being trained. Per step:

* **step**: the trainer's wall time for the step (callback ``on_step_begin`` -> ``on_step_end``);
* **rollout**: the rollout call (episodes: sandbox start, agent CLI, turns, verifier, sandbox removal);
* **generation**: the engine's busy time (prefill + decode on the model, serialized);
* **agent + sandbox**: rollout minus generation (the agent's own work, its tools, the verifier, and the
  turns an episode waited for the engine while the other episode's turn was sampled);
* **training**: step minus rollout (the trainer's forward, backward and optimizer step);
* **gateway's own time**: an upper bound: the CPU time of the rollouts' event-loop thread (the gateway's
  HTTP handling, parsing, answers, recording, and also the sandbox plumbing that shares the loop) plus the
  prompt rendering the tito policy does in worker threads. Goal: <= 2 % of the step.

With ``--overlap`` the episodes of each step after the first were started during the previous step's
training: **rollout** is then only what the call still waited for, and **overlap** the seconds its
episodes ran while the trainer trained (``AresRollouts.calls``). ``--compare`` runs both modes, each on a
freshly loaded model, and prints the median step of each and overlap's / sequential's.

Figures are medians over the steps (2 shared cores: noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ares_gateway import EpisodeConfig, RunConfig
from bench.support.render_clock import RenderClock

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

EVERY_ANSWER_IS_A_COMMAND = r"\A(.+)\Z"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--step-limit", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--overlap", action="store_true", help="rollout_func(overlap=True)")
    ap.add_argument("--compare", action="store_true", help="run without and with overlap, report both")
    args = ap.parse_args()
    modes = [False, True] if args.compare else [args.overlap]
    results = {("overlap" if m else "sequential"): measure(args, overlap=m) for m in modes}
    if args.compare:
        ratio = results["overlap"]["median"]["step_s"] / results["sequential"]["median"]["step_s"]
        if args.json:
            print(json.dumps({"settings": vars(args), **results, "step_ratio": ratio}, indent=2))
            return 0
        for name, r in results.items():
            report(name, args, r["median"])
        print(f"median step: sequential {results['sequential']['median']['step_s']:.2f} s, overlap "
              f"{results['overlap']['median']['step_s']:.2f} s, overlap / sequential {ratio:.2f}")
        return 0
    (result,) = results.values()
    if args.json:
        print(json.dumps({"settings": vars(args), **result}, indent=2))
        return 0
    report("overlap" if args.overlap else "sequential", args, result["median"])
    return 0


def measure(args: argparse.Namespace, *, overlap: bool) -> dict[str, Any]:
    """One training run of ``args.steps`` + 1 steps; the figures of the steps after the first."""

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from ares_gateway.tokens.tokenizer import default_model_path
    from ares_gateway.trainers.trl import reward_from_episode, rollout_func

    folder, name = os.path.split(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.is_quantized = False
    model.hf_quantizer = None
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)

    render = RenderClock()  # the tito policy's prompt rendering, in worker threads

    out = tempfile.mkdtemp(prefix="bench-training-")
    rollouts = rollout_func(
        "examples", max_tokens=args.max_tokens, overlap=overlap,
        episode=EpisodeConfig(
            "mini-swe-agent", step_limit=args.step_limit,
            harness_options={"action_regex": EVERY_ANSWER_IS_A_COMMAND}, sandbox="local",
        ),
        run=RunConfig(concurrency=args.concurrency, out=out),
    )
    per_call: list[dict[str, float]] = []

    async def loop_cpu() -> float:
        return time.thread_time()

    def observed(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        cpu0 = rollouts._loop.run(loop_cpu()) if rollouts._loop is not None else None
        r0 = render.seconds
        t0 = time.perf_counter()
        batch = rollouts(prompts, trainer)
        wall = time.perf_counter() - t0
        assert rollouts._loop is not None
        cpu1 = rollouts._loop.run(loop_cpu())
        per_call.append({"rollout_s": wall, "generation_s": rollouts.calls[-1]["generation_s"],
                         "overlap_s": rollouts.calls[-1].get("overlap_s", 0.0),
                         "loop_cpu_s": cpu1 - cpu0 if cpu0 is not None else float("nan"),
                         "render_s": render.seconds - r0, "episodes": len(batch["session_id"]),
                         "sampled_tokens": sum(batch["sampled_tokens"]),
                         "turns": sum(batch["turns"])})
        return batch

    steps: list[float] = []

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            steps.append(time.perf_counter() - self.t0)

    cfg = GRPOConfig(output_dir=os.path.join(out, "trainer"), per_device_train_batch_size=2,
                     num_generations=2, max_steps=args.steps + 1, use_cpu=True, bf16=False,
                     learning_rate=3e-4, logging_steps=1, report_to=[], save_strategy="no", beta=0.0, seed=7,
                     # overlap samples the model in the trainer's mode
                     disable_tqdm=True, disable_dropout=True)
    trainer = GRPOTrainer(model=model, processing_class=tokenizer,
                          reward_funcs=[reward_from_episode, lambda completions, mean_logprob,
                                        **_: mean_logprob],
                          train_dataset=Dataset.from_dict(
                              {"prompt": ["fix-median-bug", "write-greeting-file"]}),
                          args=cfg, rollout_func=observed, callbacks=[Clock()])
    try:
        trainer.train()
    finally:
        rollouts.close()
        render.close()
    # The first call starts the loop and warms the engine: the figures are of the steps after it.
    rows = []
    for step_s, c in list(zip(steps, per_call, strict=False))[1:]:
        gateway = c["loop_cpu_s"] + c["render_s"]
        rows.append({
            "step_s": step_s, "rollout_s": c["rollout_s"], "generation_s": c["generation_s"],
            "agent_sandbox_s": c["rollout_s"] - c["generation_s"], "training_s": step_s - c["rollout_s"],
            "gateway_own_s": gateway, "gateway_share": gateway / step_s,
            "loop_cpu_s": c["loop_cpu_s"], "render_s": c["render_s"],
            "turns": c["turns"], "sampled_tokens": c["sampled_tokens"], "overlap_s": c["overlap_s"],
        })
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return {"median": med, "steps": rows}


def report(name: str, args: argparse.Namespace, med: dict[str, float]) -> None:
    print(f"GRPO step on real episodes ({name}): {args.steps} steps after a warm-up, 2 episodes a step, "
          f"step_limit {args.step_limit}, max_tokens {args.max_tokens}, concurrency {args.concurrency}")
    rollout = "  rollout (the call's wait)" if name == "overlap" else "  rollout (episodes)"
    rows = [("step_s", "step"), ("rollout_s", rollout),
            ("generation_s", "    generation (engine busy in the call)"),
            ("agent_sandbox_s", "    agent + sandbox + waits"),
            ("training_s", "  training (forward, backward, optimizer)"),
            ("gateway_own_s", "gateway's own time (upper bound)")]
    if name == "overlap":
        rows.append(("overlap_s", "episodes run during the previous step's training"))
    for key, label in rows:
        share = med[key] / med["step_s"]
        print(f"{label:<50} {med[key]:8.2f} s  {share:6.1%}")
    print(f"  of which event-loop CPU {med['loop_cpu_s']:.3f} s, rendering {med['render_s']:.3f} s; "
          f"{med['turns']:.0f} turns, {med['sampled_tokens']:.0f} sampled tokens a step")


if __name__ == "__main__":
    sys.exit(main())
