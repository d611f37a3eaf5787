"""Train a model with TRL's GRPOTrainer on real agent episodes: every completion is one episode of a real
agent CLI in a sandbox, sampled token-in/token-out from the model being trained, rewarded by the task's tests.

    python3 -m pip install -e '.[model,trl]'
    python3 examples/train_trl.py --steps 2                       # SmolLM2-135M on CPU, local sandboxes
    python3 examples/train_trl.py --model /models/qwen3-0.6b --tasks fix-median-bug --sandbox docker

``--model`` is a Hugging Face folder (or a ``.gguf`` file, dequantized); the gateway renders prompts with
the same model's tokenizer (checked against the trainer's on the first step). The default is the
embedded SmolLM2-135M-Instruct, which solves none of these tasks: every verifier reward is 0 and GRPO
learns nothing from it alone. ``--format-reward`` (on by default) adds a second reward read from what
the gateway recorded: the share of the episode's answers mini-swe-agent could parse into an action
(``ares_gateway.trainers.rewards``; here any fenced block is an action, which the untrained model writes
in about one answer of eight), so the demo's steps have a real signal to follow. No reward reads the
model's logprobs. See docs/training.md ("Learning curve" for a longer run of the same recipe).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ares_gateway import EpisodeConfig, RunConfig

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

#: mini-swe-agent's action regex here: any fenced block (```bash, ```sh, ```python, bare ```).
FENCED_BLOCK_REGEX = r"```[A-Za-z]*[ \t]*\n(.*?)\n```"


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
    # A model in training writes servers and waits too (`python -m http.server`): cut each command.
    ap.add_argument("--command-timeout", type=float, default=30.0, help="seconds one agent command may run")
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens per answer")
    ap.add_argument("--concurrency", type=int, default=2, help="episodes at once")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--out", default="runs/train-trl", help="trainer output and each step's episodes")
    ap.add_argument("--format-reward", action=argparse.BooleanOptionalAction, default=True,
                    help="add the share of answers mini-swe-agent parsed into an action as a second reward "
                         "(mini-swe-agent only; see the docstring)")
    ap.add_argument("--action-regex", default=FENCED_BLOCK_REGEX,
                    help="mini-swe-agent's action regex (default: any fenced block; mini's own wants "
                         "```mswea_bash_command, which a small model rarely writes)")
    ap.add_argument("--overlap", action="store_true",
                    help="run the next step's episodes while the trainer trains (docs/training.md, Overlap)")
    args = ap.parse_args(argv)

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from ares_gateway.trainers.rewards import FormatRule, format_rewards_column, from_column
    from ares_gateway.trainers.trl import reward_from_episode, rollout_func

    model, tokenizer, source = load(args.model)
    mini = args.harness == "mini-swe-agent"
    options: dict[str, Any] = {"command_timeout": args.command_timeout}
    if mini:
        options |= {"action_format": "text", "action_regex": args.action_regex}
    rollouts = rollout_func(
        args.dataset, max_tokens=args.max_tokens, tokenizer=source, overlap=args.overlap,
        episode=EpisodeConfig(args.harness, options, sandbox=args.sandbox, step_limit=args.step_limit),
        run=RunConfig(concurrency=args.concurrency, out=os.path.join(args.out, "episodes")),
    )
    rewards: list[Any] = [reward_from_episode]
    rollout: Any = rollouts
    if args.format_reward and mini:
        rule = FormatRule.mini_swe_agent_text(args.action_regex)

        def rollout(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
            # The batch plus a column TRL hands the reward function below: each episode's format reward.
            batch = rollouts(prompts, trainer)
            batch["format_reward"] = format_rewards_column(rollouts.last_episodes, rule,
                                                           decode=tokenizer.decode)
            return batch

        rewards.append(from_column("format_reward"))
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
                          rollout_func=rollout)
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
