"""``ares-gateway run`` and ``ares-gateway demo`` (wired into :mod:`ares_gateway.cli`)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

POLICIES = ("oracle", "scripted", "upstream", "http")
DEMO_PRESET = "examples-mswea"
REAL_MODEL_HINT = (
    "ares-gateway run examples-mswea --policy upstream --base-url http://127.0.0.1:8000/v1 "
    "--model Qwen/Qwen3-8B --sandbox auto -n 4 --attempts 4"
)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("preset", metavar="PRESET[:selector|@i/n]",
                   help="dataset-harness preset and optional selector, e.g. examples-mswea, examples-mswea:0:2, "
                        "examples-cc@0/4 (0-based)")
    p.add_argument("--policy", choices=POLICIES, default="oracle",
                   help="who answers the agents' LLM calls (default: oracle, which plays each task's solution)")
    p.add_argument("--base-url", default=None, help="upstream: the OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None, help="upstream: the model name to ask for (default: the agent's own)")
    p.add_argument("--api-key-env", default=None, metavar="VAR",
                   help="upstream: the environment variable holding the API key (never pass the key itself)")
    p.add_argument("--command", action="append", default=[], metavar="CMD",
                   help="scripted: a shell command the agent runs before finishing (repeatable)")
    p.add_argument("--sandbox", choices=("auto", "local", "docker", "daytona"), default="auto",
                   help="sandbox backend (auto: Docker when an engine answers, else local)")
    p.add_argument("--image", default=None,
                   help="image for tasks that bring none (container backends; default ares-gateway/agents:latest)")
    p.add_argument("-n", "--concurrency", type=int, default=4, help="episodes at once (default: 4)")
    p.add_argument("--attempts", type=int, default=1, metavar="K", help="attempts per task, for pass@k (default: 1)")
    p.add_argument("--out", default=None, metavar="DIR", help="output directory (default: runs/PRESET-TIMESTAMP)")
    p.add_argument("--step-limit", type=int, default=None, help="LLM calls per episode before truncation")
    p.add_argument("--time-limit", type=float, default=None,
                   help="agent seconds per episode before truncation (default: the task's agent timeout)")
    p.add_argument("--stats", choices=("tensorboard", "logging", "null"), default="tensorboard",
                   help="where episode statistics go (default: TensorBoard event files in DIR/tb)")
    p.add_argument("--stats-period", type=float, default=10.0, help="seconds between stat flushes (default: 10)")
    p.add_argument("--host", default="127.0.0.1", help="gateway address (agents in containers use host networking)")
    p.add_argument("--port", type=int, default=0, help="gateway port (default: a free one; set it for --policy http)")
    p.add_argument("--admin-token-env", default=None, metavar="VAR",
                   help="http: the environment variable holding the admin token guarding /poll and /respond")
    p.add_argument("--log-level", default="WARNING")


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, metavar="DIR", help="output directory (default: runs/demo-TIMESTAMP)")
    p.add_argument("-n", "--concurrency", type=int, default=4, help="episodes at once (default: 4)")
    p.add_argument("--log-level", default="WARNING")


def _console() -> Any:
    from rich.console import Console

    return Console()


def _fail(message: str) -> int:
    print(f"ares-gateway: error: {message}", file=sys.stderr)
    return 2


def _build_policy(args: argparse.Namespace) -> Any:
    from ares_gateway.policies import make_policy

    if args.policy == "upstream":
        if not args.base_url:
            raise ValueError("--policy upstream needs --base-url (an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1)")
        api_key = None
        if args.api_key_env:
            api_key = os.environ.get(args.api_key_env)
            if not api_key:
                raise ValueError(f"--api-key-env {args.api_key_env}: that environment variable is not set")
        return make_policy("upstream", base_url=args.base_url, model=args.model, api_key=api_key)
    if args.policy == "scripted":
        return make_policy("scripted", commands=args.command)
    if args.command:
        raise ValueError("--command is for --policy scripted")
    return make_policy(args.policy)


def _install_signals(stop: asyncio.Event, console: Any) -> None:
    """First Ctrl-C (or SIGTERM): stop launching, cancel running episodes, write what finished.
    A second one removes every sandbox at once and exits."""
    from sandbox import janitor

    # The janitor hooks SIGINT/SIGTERM when the first sandbox starts and would remove every sandbox at
    # once, under the running episodes. Hook it now (atexit stays), so that the loop's handlers below
    # replace its signal handlers: the first signal cancels gracefully, a second one forces.
    janitor.install()
    loop = asyncio.get_running_loop()
    hits = {"n": 0}

    def handler(signum: int) -> None:
        hits["n"] += 1
        if hits["n"] == 1:
            console.print(f"[bold yellow]{signal.Signals(signum).name}: stopping: no new episodes, cancelling the "
                          "running ones and removing their sandboxes (again to force)[/]")
            stop.set()
            return
        janitor.cleanup_all(reason="forced stop")
        os._exit(130)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, handler, sig)


async def _execute(
    *, tasks: Any, harness: str, policy: Any, backend: str, args: argparse.Namespace, out: Path, console: Any,
    run_info: dict[str, Any],
) -> Any:
    from ares_gateway.episode import harness_side_call_detector
    from ares_gateway.gateway import Gateway
    from ares_gateway.rollouts import ensure_local_install, run_rollouts
    from sandbox import janitor

    stop = asyncio.Event()
    _install_signals(stop, console)
    harness_options: dict[str, Any] = {}
    if backend == "local":
        # One install on this host for every local sandbox (each would otherwise install its own).
        harness_options["install_root"] = await ensure_local_install(harness)
    admin = os.environ.get(args.admin_token_env) if getattr(args, "admin_token_env", None) else None
    longest = max([args.time_limit or 0.0, *(t.config.agent_timeout for t in tasks)])
    gateway = Gateway(host=getattr(args, "host", "127.0.0.1"), port=getattr(args, "port", 0), admin_token=admin,
                      request_timeout=longest + 120.0, side_call_detector=harness_side_call_detector(harness))
    entered = False
    try:
        if hasattr(policy, "__aenter__"):
            await policy.__aenter__()
            entered = True
        async with gateway:
            return await run_rollouts(
                tasks, harness=harness, policy=policy, sandbox=backend, concurrency=args.concurrency,
                attempts=getattr(args, "attempts", 1), out=out, step_limit=getattr(args, "step_limit", None),
                time_limit=args.time_limit, image=getattr(args, "image", None), harness_options=harness_options,
                stats=getattr(args, "stats", "tensorboard"), stats_period=getattr(args, "stats_period", 10.0),
                console=console, stop=stop, gateway=gateway, run_info=run_info,
            )
    finally:
        if entered:
            await policy.__aexit__(None, None, None)
        janitor.cleanup_all(reason="run finished")  # a safety net: every episode removes its own sandbox


def _report(summary: Any, console: Any, out: Path) -> None:
    from ares_gateway.rollouts import results_table, summary_lines

    console.print(results_table(summary))
    for line in summary_lines(summary):
        console.print(line, highlight=False, soft_wrap=True)
    console.print(f"results: {out / 'results.json'} (one line per episode as it finished: {out / 'episodes.jsonl'})",
                  highlight=False, soft_wrap=True)


def _run_async(coro: Any) -> Any:
    from ares_gateway.cli import _run

    return _run(coro)


def cmd_run(args: argparse.Namespace) -> int:
    from ares_gateway.episode import resolve_backend
    from ares_gateway.selectors import SelectorError, resolve
    from ares_gateway.tasks import TaskError

    if args.concurrency < 1 or args.attempts < 1:
        return _fail("-n and --attempts must be at least 1")
    try:
        resolved = resolve(args.preset)
        policy = _build_policy(args)
        backend = resolve_backend(args.sandbox)
    except (SelectorError, TaskError, ValueError) as exc:
        return _fail(str(exc))
    if not resolved.tasks:
        return _fail(f"{args.preset} selects no task")
    out = Path(args.out or f"runs/{resolved.preset.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    console = _console()
    console.print(
        f"[bold]ares-gateway run[/] {args.preset}: {len(resolved.tasks)} task(s) x {args.attempts} attempt(s), "
        f"harness {resolved.preset.harness}, policy {args.policy}, sandbox {backend}, concurrency {args.concurrency}",
        highlight=False, soft_wrap=True,
    )
    run_info = {"preset": args.preset, "policy": args.policy, "sandbox": backend, "model": args.model,
                "base_url": args.base_url, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    summary = _run_async(_execute(tasks=resolved.tasks, harness=resolved.preset.harness, policy=policy,
                                  backend=backend, args=args, out=out, console=console, run_info=run_info))
    _report(summary, console, out)
    if args.stats == "tensorboard":
        console.print(f"TensorBoard: tensorboard --logdir {out / 'tb'}", highlight=False, soft_wrap=True)
    return 130 if summary.interrupted else 0


def cmd_demo(args: argparse.Namespace) -> int:
    from ares_gateway.policies import make_policy
    from ares_gateway.selectors import resolve

    resolved = resolve(DEMO_PRESET)
    out = Path(args.out or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    console = _console()
    console.print(
        f"[bold]ares-gateway demo[/]: the {len(resolved.tasks)} bundled example tasks, each solved by the real "
        "mini-swe-agent CLI in a local sandbox. Every LLM call it makes goes to the gateway, where the [bold]oracle"
        "[/] policy answers by playing the task's solution/solve.sh through the agent's own tool calls; the task's "
        "tests then give the reward. No API key, Docker or GPU needed.",
        highlight=False, soft_wrap=True,
    )
    args.attempts, args.time_limit, args.step_limit = 1, None, None
    run_info = {"preset": DEMO_PRESET, "policy": "oracle", "sandbox": "local", "demo": True,
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    summary = _run_async(_execute(tasks=resolved.tasks, harness=resolved.preset.harness, policy=make_policy("oracle"),
                                  backend="local", args=args, out=out, console=console, run_info=run_info))
    _report(summary, console, out)
    samples = sum(e.samples for e in summary.episodes)
    console.print(
        f"\nTrajectories: {out / 'trajectories'} ({samples} training samples: the oracle sends no token ids; an "
        f"upstream policy on vLLM or SGLang records the engine's tokens and logprobs there)\n"
        f"Raw turns (every request as the agent sent it, every answer): {out / 'turns'}\n"
        f"Agent and verifier logs: {out / 'logs'}\n"
        f"TensorBoard: tensorboard --logdir {out / 'tb'}\n\n"
        f"Point it at a real model (any OpenAI-compatible server; add --api-key-env VAR for a hosted API):\n"
        f"  {REAL_MODEL_HINT}",
        highlight=False, soft_wrap=True,
    )
    if summary.interrupted:
        return 130
    ok = len(summary.episodes) == summary.planned and all(e.reward >= 1.0 for e in summary.episodes)
    return 0 if ok else 1
