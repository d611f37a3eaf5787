"""Train a model with TRL's GRPOTrainer on real agent episodes: every completion is one episode of a real
agent CLI in a sandbox, sampled token-in/token-out from the model being trained, rewarded by the task's tests.

    python3 -m pip install -e '.[model,trl]'
    python3 examples/train_trl.py --steps 2                       # SmolLM2-135M on CPU, local sandboxes
    python3 examples/train_trl.py --model /models/qwen3-0.6b --tasks fix-median-bug --sandbox docker

``--model`` is a Hugging Face folder (or a ``.gguf`` file, dequantized); the gateway renders prompts with
the same model's tokenizer (checked against the trainer's on the first step). The default is the
embedded SmolLM2-135M-Instruct, which solves none of the bundled tasks: every verifier reward is 0 and
GRPO learns nothing from it; ``--shaping`` adds the completion's mean sampled logprob as a second reward
so the demo's steps have something to follow. See docs/training.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def load(model: str | None) -> tuple[Any, Any, str | None]:
    """The model (float32), its tokenizer, and the file or folder the gateway renders with."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ares_gateway.tokens.tokenizer import default_model_path

    path = model or default_model_path()
    if path.endswith(".gguf"):
        folder, name = os.path.split(path)
        m = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        m.is_quantized = False  # loaded from a quantized file: trainable once dequantized
        m.hf_quantizer = None
        return m, AutoTokenizer.from_pretrained(folder, gguf_file=name), path
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(
        path), path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None,
                    help="a Hugging Face folder or .gguf file (default: embedded SmolLM2)")
    ap.add_argument("--dataset", default="examples", help="a registered task dataset or a folder of tasks")
    ap.add_argument("--tasks", default="fix-median-bug,write-greeting-file",
                    help="comma-separated task names")
    ap.add_argument("--harness", default="mini-swe-agent")
    ap.add_argument("--sandbox", default="local", choices=("local", "docker", "daytona", "auto"))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--num-generations", type=int, default=2)
    ap.add_argument("--step-limit", type=int, default=4, help="LLM calls per episode")
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens per answer")
    ap.add_argument("--concurrency", type=int, default=2, help="episodes at once")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--out", default="runs/train-trl", help="trainer output and each step's episodes")
    ap.add_argument("--shaping", action=argparse.BooleanOptionalAction, default=True,
                    help="add the mean sampled logprob as a second reward (see the docstring)")
    ap.add_argument("--any-answer-is-a-command", action=argparse.BooleanOptionalAction, default=True,
                    help="mini-swe-agent takes the whole answer as its command (a small model rarely writes "
                         "mini's fenced block, and mini drops answers without one from its history)")
    ap.add_argument("--overlap", action="store_true",
                    help="run the next step's episodes while the trainer trains (docs/training.md, Overlap)")
    args = ap.parse_args(argv)

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from ares_gateway.trainers.trl import reward_from_episode, rollout_func

    model, tokenizer, source = load(args.model)
    options = ({"action_regex": r"\A(.+)\Z"} if args.any_answer_is_a_command
               and args.harness == "mini-swe-agent" else {})
    rollouts = rollout_func(args.dataset, harness=args.harness, sandbox=args.sandbox,
                            step_limit=args.step_limit, max_tokens=args.max_tokens,
                            concurrency=args.concurrency, tokenizer=source,
                            harness_options=options, out=os.path.join(args.out, "episodes"),
                            overlap=args.overlap)
    rewards: list[Any] = [reward_from_episode]
    if args.shaping:
        def mean_logprob(completions: list[Any], mean_logprob: list[float], **_: Any) -> list[float]:
            return [float(x) for x in mean_logprob]
        rewards.append(mean_logprob)
    config = GRPOConfig(
        output_dir=args.out, per_device_train_batch_size=args.num_generations,
        num_generations=args.num_generations, max_steps=args.steps, learning_rate=args.lr, logging_steps=1,
        # fp32: sampler and trainer logprobs agree to ~1e-5
        report_to=[], save_strategy="no", use_cpu=not _has_gpu(), bf16=False,
        beta=0.0, disable_dropout=True,  # overlap samples the model in the trainer's mode
    )
    tasks = [t for t in args.tasks.split(",") if t]
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=rewards,
                          train_dataset=Dataset.from_dict({"prompt": tasks}), args=config,
                          rollout_func=rollouts)
    try:
        trainer.train()
    finally:
        rollouts.close()
    for call in rollouts.calls:
        print(f"step {call['step']}: {call['episodes']} episodes in {call['seconds']:.1f} s "
              f"(generation {call['generation_s']:.1f} s), {call['failed']} failed, mean reward "
              f"{call['mean_reward']:.2f}"
              + (f", {call['prefetched']} started during the last step" if "prefetched" in call else ""))
    return 0


def _has_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


if __name__ == "__main__":
    sys.exit(main())
