"""A learning curve from real agent episodes on CPU: GRPO (TRL's GRPOTrainer) trains
SmolLM2-135M-Instruct, which samples every turn of mini-swe-agent (text mode) in local sandboxes through
the gateway, token-in/token-out.

    python3 bench/bench_learning_curve.py --seeds 0,1,2 --steps 10          # the curve, ~60 min
    python3 bench/bench_learning_curve.py --seeds 0 --steps 10 --ablation   # env_mask 1 on tool output too

Two rewards, logged apart: ``task`` (the task's verifier, 0 or 1) and ``format`` (the share of the episode's
LLM calls whose answer mini-swe-agent could parse into an action: the recorded answers' token ids decoded
and matched by mini's rule, exactly one match of its action regex, here any fenced block:
:mod:`ares_gateway.trainers.rewards`); GRPO trains on their sum. Nothing is read
from the model's logprobs. Writes to ``--out``: ``curve.json`` (per seed and step the mean of each reward,
the per-step mean and spread across seeds, wall times, the goal check), ``curve.png`` (matplotlib where
installed, else drawn with Pillow), TensorBoard scalars (``tb/``) and each step's episodes. The goal check:
the mean format reward over the last fifth of the steps above the first fifth's by more than the seeds'
spread (the bands mean +- std across seeds do not overlap), and the task reward's last fifth not below its
first. See docs/training.md, "Learning curve".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DATASET = os.path.join(HERE, "..", "examples", "curve-tasks")
# mini-swe-agent's action regex here, as in the example: any fenced block. Untrained SmolLM2 writes
# exactly one in ~1 of 8 first answers at 48 tokens (mini's own tag: 0 of 32, the ```bash/```sh
# LENIENT_ACTION_REGEX: 1 of 32): a format reward with variance in most groups.
from train_trl import FENCED_BLOCK_REGEX  # noqa: E402 (examples/ is on the path only from here)

from ares_gateway import EpisodeConfig, RunConfig  # noqa: E402


class CurveRollouts:
    """TRL's rollout function with the format reward as an extra column (``format_reward``), each call's
    rewards and time kept; with ``ablation`` every sampled entry's ``env_mask`` is 1 on all its tokens."""

    def __init__(self, inner: Any, rule: Any, decode: Any, *, ablation: bool) -> None:
        self.inner = inner
        self.rule = rule
        self.decode = decode
        self.ablation = ablation
        self.steps: list[dict[str, Any]] = []
        self._last: float | None = None

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        from ares_gateway.trainers.rewards import format_score

        started = time.monotonic()
        out = self.inner(prompts, trainer)
        scores = [format_score(e, self.rule, decode=self.decode) for e in self.inner.last_episodes]
        out["format_reward"] = [s.reward for s in scores]
        if self.ablation:
            out["env_mask"] = [[1] * len(m) if n else m
                               for m, n in zip(out["env_mask"], out["sampled_tokens"], strict=True)]
        task = [float(r) for r in out["reward"]]
        self.steps.append({
            "step": len(self.steps), "task": statistics.fmean(task),
            "format": statistics.fmean(out["format_reward"]),
            "parsed": sum(s.parsed for s in scores), "calls": sum(s.calls for s in scores),
            "episodes": len(task), "failed": sum(1 for e in self.inner.last_episodes if e.error),
            "rollout_s": time.monotonic() - started,
            # From the previous call's start: that call's episodes plus the trainer's step on them.
            "since_last_s": (started - self._last) if self._last is not None else None,
        })
        self._last = started
        last = self.steps[-1]
        print(f"  step {last['step']}: format {last['format']:.2f} ({last['parsed']}/{last['calls']}), "
              f"task {last['task']:.2f}, rollout {last['rollout_s']:.0f} s", flush=True)
        return out

    def close(self) -> None:
        self.inner.close()


def run_seed(args: argparse.Namespace, seed: int, out: str) -> dict[str, Any]:
    """One GRPO run: a fresh model, ``args.steps`` steps; its per-step rewards and times."""
    from datasets import Dataset
    from train_trl import load
    from transformers import set_seed
    from trl import GRPOConfig, GRPOTrainer

    from ares_gateway.trainers.rewards import FormatRule, from_column
    from ares_gateway.trainers.trl import reward_from_episode, rollout_func

    set_seed(seed)
    model, tokenizer, source = load(args.model)
    inner = rollout_func(
        args.dataset, max_tokens=args.max_tokens, tokenizer=source,
        episode=EpisodeConfig(
            "mini-swe-agent", sandbox=args.sandbox, step_limit=args.step_limit, time_limit=args.time_limit,
            harness_options={"action_format": "text", "action_regex": args.action_regex,
                                          "command_timeout": args.command_timeout},
        ),
        run=RunConfig(concurrency=args.concurrency, out=os.path.join(out, "episodes")),
    )
    rollouts = CurveRollouts(inner, FormatRule.mini_swe_agent_text(args.action_regex), tokenizer.decode,
                             ablation=args.ablation)
    tasks = [t for t in args.tasks.split(",") if t]
    config = GRPOConfig(
        output_dir=out, per_device_train_batch_size=args.num_generations,
        num_generations=args.num_generations,
        max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type=args.lr_scheduler,
        logging_steps=1, report_to=[], save_strategy="no",
        use_cpu=True, bf16=False, beta=0.0, disable_dropout=True, seed=seed,
    )
    trainer = GRPOTrainer(model=model, processing_class=tokenizer,
                          reward_funcs=[reward_from_episode, from_column("format_reward")],
                          train_dataset=Dataset.from_dict({"prompt": tasks}), args=config,
                          rollout_func=rollouts)
    started = time.monotonic()
    try:
        trainer.train()
    finally:
        rollouts.close()
    wall = time.monotonic() - started
    zero_std = [h["frac_reward_zero_std"] for h in trainer.state.log_history if "frac_reward_zero_std" in h]
    for s, z in zip(rollouts.steps, zero_std, strict=False):
        s["frac_reward_zero_std"] = z
    return {"seed": seed, "wall_s": wall, "steps": rollouts.steps}


def base_rate(run_dir: str, budgets: list[int], samples: int, model_path: str | None,
              regex: str) -> list[dict[str, Any]]:
    """How often the untrained model's first answer parses, per answer budget: the first recorded
    prompt of a run's first step (mini's text-mode prompt as the gateway rendered it, token ids)
    sampled ``samples`` times at temperature 1 for each budget (tokens), each answer checked by the
    format reward's rule. What chooses ``--max-tokens``: GRPO learns from groups whose rewards differ."""
    import glob

    import torch
    from train_trl import load

    from ares_gateway.trainers.rewards import FormatRule

    found = sorted(glob.glob(os.path.join(run_dir, "seed-*", "episodes", "step-0", "turns", "*.jsonl")))
    if not found:
        raise SystemExit(f"no recorded turns under {run_dir}/seed-*/episodes/step-0/turns: "
                         "run the curve first")
    with open(found[0]) as f:
        prompt = json.loads(f.readline())["completion"]["tokens"]["prompt_ids"]
    rule = FormatRule.mini_swe_agent_text(regex)
    model, tokenizer, _ = load(model_path)
    model.eval()
    torch.manual_seed(0)
    ids = torch.tensor([prompt])
    rows = []
    for budget in budgets:
        parsed, t0 = 0, time.monotonic()
        with torch.no_grad():
            for start in range(0, samples, 8):
                n = min(8, samples - start)
                out = model.generate(ids.repeat(n, 1), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                     max_new_tokens=budget, pad_token_id=tokenizer.eos_token_id)
                parsed += sum(rule.parses(tokenizer.decode(row[len(prompt):], skip_special_tokens=True))
                              for row in out)
        rows.append({"max_tokens": budget, "parsed": parsed, "samples": samples,
                     "share": parsed / samples, "seconds": time.monotonic() - t0})
        print(f"max_tokens {budget}: {parsed}/{samples} first answers parse ({parsed / samples:.2f})",
              flush=True)
    return rows


def _fifth(values: list[float], last: bool) -> float:
    k = max(1, len(values) // 5)
    return statistics.fmean(values[-k:] if last else values[:k])


def _band(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per step the mean and spread (std, min, max) across seeds of each reward; the goal check."""
    steps = min(len(r["steps"]) for r in runs)
    curve = []
    for i in range(steps):
        row: dict[str, Any] = {"step": i}
        for key in ("format", "task"):
            xs = [r["steps"][i][key] for r in runs]
            mean, std = _band(xs)
            row[key] = {"mean": mean, "std": std, "min": min(xs), "max": max(xs)}
        curve.append(row)
    goal: dict[str, Any] = {"seeds": len(runs), "steps": steps, "fifth": max(1, steps // 5)}
    for key in ("format", "task"):
        first = [_fifth([s[key] for s in r["steps"][:steps]], last=False) for r in runs]
        last = [_fifth([s[key] for s in r["steps"][:steps]], last=True) for r in runs]
        goal[key] = {"first": _band(first), "last": _band(last)}
    (fm, fs), (lm, ls) = goal["format"]["first"], goal["format"]["last"]
    goal["format_rose"] = lm - ls > fm + fs if len(runs) > 1 else None
    goal["task_not_lower"] = goal["task"]["last"][0] >= goal["task"]["first"][0]
    goal["met"] = bool(goal["format_rose"] and goal["task_not_lower"])
    return {"curve": curve, "goal": goal}


def write_tensorboard(folder: str, runs: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(folder)
    try:
        for row in summary["curve"]:
            for key in ("format", "task"):
                w.add_scalar(f"curve/{key}_mean", row[key]["mean"], row["step"])
                w.add_scalar(f"curve/{key}_std", row[key]["std"], row["step"])
        for r in runs:
            for s in r["steps"]:
                for key in ("format", "task"):
                    w.add_scalar(f"seed{r['seed']}/{key}", s[key], s["step"])
                w.add_scalar(f"seed{r['seed']}/rollout_s", s["rollout_s"], s["step"])
    finally:
        w.close()


def plot(path: str, summary: dict[str, Any], title: str) -> str:
    """The per-step mean of each reward with a +- std band; matplotlib where installed, else Pillow."""
    curve = summary["curve"]
    series = {k: ([r[k]["mean"] for r in curve], [r[k]["std"] for r in curve]) for k in ("format", "task")}
    colors = {"format": (31, 119, 180), "task": (214, 39, 40)}
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _plot_pillow(path, series, colors, title)
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = list(range(len(curve)))
    for k, (m, s) in series.items():
        c = tuple(v / 255 for v in colors[k])
        ax.plot(xs, m, label=f"{k} reward", color=c)
        ax.fill_between(xs, [a - b for a, b in zip(m, s, strict=True)],
                        [a + b for a, b in zip(m, s, strict=True)], color=c, alpha=0.2)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward (+- std across seeds)")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return "matplotlib"


def _plot_pillow(path: str, series: dict[str, tuple[list[float], list[float]]],
                 colors: dict[str, tuple[int, ...]], title: str) -> str:
    from PIL import Image, ImageDraw

    width, height, pad = 700, 400, 50
    img = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(img)
    d.rectangle([pad, pad, width - pad, height - pad], outline="black")
    n = max(len(m) for m, _ in series.values())

    def xy(i: int, v: float) -> tuple[float, float]:
        x = pad + (width - 2 * pad) * (i / (n - 1) if n > 1 else 0.5)
        return x, height - pad - (height - 2 * pad) * min(1.0, max(0.0, v))

    for tick in (0.0, 0.5, 1.0):
        _, y = xy(0, tick)
        d.text((8, y - 6), f"{tick:.1f}", fill="black")
    d.text((pad, 15), f"{title}: mean reward +- std across seeds per GRPO step", fill="black")
    for row, (k, (m, s)) in enumerate(series.items()):
        c = colors[k]
        for i in range(n):
            x, top = xy(i, m[i] + s[i])
            _, bottom = xy(i, m[i] - s[i])
            d.line([x, top, x, bottom], fill=tuple(int(v + (255 - v) * 0.6) for v in c), width=3)
        points = [xy(i, v) for i, v in enumerate(m)]
        if len(points) > 1:
            d.line(points, fill=c, width=2)
        for x, y in points:
            d.ellipse([x - 3, y - 3, x + 3, y + 3], fill=c)
        d.text((width - pad - 110, pad + 8 + 14 * row), f"{k} reward", fill=c)
    d.text((width // 2 - 30, height - pad + 15), "GRPO step", fill="black")
    img.save(path)
    return "pillow (matplotlib is not installed)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds, one GRPO run each")
    ap.add_argument("--steps", type=int, default=10, help="GRPO steps per seed")
    ap.add_argument("--model", default=None,
                    help="a Hugging Face folder or .gguf file (default: embedded SmolLM2)")
    ap.add_argument("--dataset", default=DEFAULT_DATASET,
                    help="a registered task dataset or a folder of tasks")
    ap.add_argument("--tasks", default="create-done-file", help="comma-separated task names")
    ap.add_argument("--sandbox", default="local", choices=("local", "docker", "daytona", "auto"))
    ap.add_argument("--num-generations", type=int, default=4,
                    help="episodes per GRPO group (one group a step)")
    ap.add_argument("--step-limit", type=int, default=2, help="LLM calls per episode")
    # 48 tokens: the untrained model opens a fenced block in ~2 of 5 answers but closes one in ~1 of 12
    # (mini parses none of the unclosed ones); 80 leaves room for a short command and its closing fence.
    ap.add_argument("--max-tokens", type=int, default=80, help="tokens per answer")
    ap.add_argument("--concurrency", type=int, default=2, help="episodes at once")
    ap.add_argument("--time-limit", type=float, default=900.0,
                    help="seconds per episode (a 48-token answer takes ~40-80 s on 2 loaded cores)")
    ap.add_argument("--action-regex", default=FENCED_BLOCK_REGEX,
                    help="mini-swe-agent's action regex (text mode), also the format reward's rule")
    # The untrained model's commands include servers (`python -m http.server`): without a cut, one such
    # episode holds its whole GRPO step until --time-limit.
    ap.add_argument("--command-timeout", type=float, default=10.0, help="seconds one agent command may run")
    ap.add_argument("--lr", type=float, default=1e-4)
    # Constant: over 14 steps TRL's default linear decay leaves the last fifth (the goal's) at <15 % of it.
    ap.add_argument("--lr-scheduler", default="constant", help="transformers' lr_scheduler_type")
    ap.add_argument("--ablation", action="store_true",
                    help="train on every completion token: env_mask forced to 1 on tool output too")
    ap.add_argument("--out", default="runs/learning-curve")
    ap.add_argument("--base-rate", metavar="RUN_DIR", default=None,
                    help="instead of training: how often the untrained model's first answer parses at each "
                         "--budgets, sampled from the first prompt a run in RUN_DIR recorded")
    ap.add_argument("--budgets", default="80,128,160,192", help="--base-rate: answer budgets, in tokens")
    ap.add_argument("--samples", type=int, default=32, help="--base-rate: answers per budget")
    args = ap.parse_args(argv)
    if args.base_rate:
        base_rate(args.base_rate, [int(b) for b in args.budgets.split(",") if b.strip()], args.samples,
                  args.model, args.action_regex)
        return 0
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if not seeds or args.steps < 1:
        ap.error("give at least one seed and one step")
    os.makedirs(args.out, exist_ok=True)
    started = time.monotonic()
    runs = []
    for seed in seeds:
        run = run_seed(args, seed, os.path.join(args.out, f"seed-{seed}"))
        runs.append(run)
        for s in run["steps"]:
            print(f"seed {seed} step {s['step']}: format {s['format']:.2f} ({s['parsed']}/{s['calls']} "
                  f"answers parsed), task {s['task']:.2f}, rollout {s['rollout_s']:.1f} s", flush=True)
    wall = time.monotonic() - started
    summary = summarize(runs)
    title = "learning curve" + (" (ablation: env_mask 1 on tool output)" if args.ablation else "")
    plotted = plot(os.path.join(args.out, "curve.png"), summary, title)
    write_tensorboard(os.path.join(args.out, "tb"), runs, summary)
    step_times = [s["since_last_s"] for r in runs for s in r["steps"] if s["since_last_s"] is not None]
    report = {"args": vars(args), "seeds": seeds, "wall_s": wall, "runs": runs, **summary, "plot": plotted,
              "step_s_mean": statistics.fmean(step_times) if step_times else None}
    with open(os.path.join(args.out, "curve.json"), "w") as f:
        json.dump(report, f, indent=1,
                  default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o))
    g = summary["goal"]
    print(f"wall time {wall:.0f} s for {len(seeds)} seed(s) x {args.steps} step(s); plot: {plotted}")
    for key in ("format", "task"):
        (fm, fs), (lm, ls) = g[key]["first"], g[key]["last"]
        print(f"{key} reward: first fifth {fm:.3f} +- {fs:.3f}, last fifth {lm:.3f} +- {ls:.3f}")
    rose = ("not checkable with one seed" if g["format_rose"] is None
            else ("yes" if g["format_rose"] else "no"))
    print(f"goal: format rose beyond the seeds' spread: {rose}; task not lower: "
          f"{'yes' if g['task_not_lower'] else 'no'}; met: {'yes' if g['met'] else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
