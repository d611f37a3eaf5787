"""The ``ares-gateway`` command line: ``serve``, ``run``, ``demo``, ``gc`` (``--help`` on each)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from typing import Any

from ares_gateway.gateway import Gateway, GatewayConfig
from ares_gateway.runtime import tune_gc

log = logging.getLogger("ares_gateway")

_DESCRIPTION = (
    "Run real coding-agent CLIs in sandboxes while every LLM call they make goes through the gateway, is "
    "answered by a policy and recorded as training samples. Start with: ares-gateway demo"
)


def version() -> str:
    """The installed package's version (the source tree's, when run from a checkout that is not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _version

    try:
        return _version("ares-gateway")
    except PackageNotFoundError:  # pragma: no cover - run from a source tree without an install
        return "unknown (not installed)"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help with every option's default (when its help does not say it already) and descriptions and
    epilogs kept as written (their line breaks are lists)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:  # a list (the run epilog): as written
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return argparse.HelpFormatter._fill_text(self, text, width, indent)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (not action.option_strings or action.default is argparse.SUPPRESS or "(default" in text
                or isinstance(action, argparse._VersionAction)):
            return text
        default = action.default
        if isinstance(action, argparse._StoreTrueAction):
            shown = "off"
        elif default == []:
            shown = "none"
        elif default is None:
            shown = "not set"
        else:
            shown = "%(default)s"
        return f"{text} (default: {shown})" if text else f"(default: {shown})"


def _run(main: Any) -> Any:
    """Run a coroutine on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        return asyncio.run(main)
    return uvloop.run(main)


async def _serve(cfg: GatewayConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with Gateway(cfg) as gw:
        # The admin token is a secret: say whether one is set, never what it is.
        print(
            f"ares-gateway listening on {gw.url} (admin token {'required' if cfg.admin_token else 'not set'}; "
            f"sessions {'auto-created' if cfg.auto_sessions else 'created with POST /sessions'})",
            flush=True,
        )
        await stop.wait()
        log.info("shutting down: failing %d parked request(s)", gw.broker.pending_count)


def _cmd_serve(args: argparse.Namespace) -> int:
    admin = args.admin_token or os.environ.get("ARES_GATEWAY_ADMIN_TOKEN") or None
    cfg = GatewayConfig(
        host=args.host,
        port=args.port,
        admin_token=admin,
        request_timeout=args.request_timeout,
        lease_seconds=args.lease,
        max_body_bytes=args.max_body_mb * 1024 * 1024,
        auto_sessions=args.auto_sessions,
        models=args.model or ["ares-gateway"],
        public_url=args.public_url,
        access_log=args.access_log,
    )
    if cfg.host not in ("127.0.0.1", "localhost", "::1") and not admin:
        print(
            "warning: listening on a non-loopback address without --admin-token: anyone who can reach it "
            "can create sessions and answer requests",
            file=sys.stderr,
        )
    tune_gc()
    with contextlib.suppress(KeyboardInterrupt):
        _run(_serve(cfg))
    return 0


def _add_serve_command(sub: Any) -> None:
    p = sub.add_parser("serve", help="run the gateway (agents talk to it; a policy answers through /poll)",
                       description="Run the gateway: agents talk to it; a policy answers through /poll and /respond.",
                       formatter_class=HelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port to bind; 0 picks a free one (default: 8080)")
    p.add_argument(
        "--admin-token",
        default=None,
        help="token guarding /poll, /respond, /sessions, /metrics (or env ARES_GATEWAY_ADMIN_TOKEN)",
    )
    p.add_argument("--request-timeout", type=float, default=900.0, help="seconds a request waits for its answer")
    p.add_argument("--lease", type=float, default=120.0, help="seconds before an unanswered polled request is redelivered")
    p.add_argument("--max-body-mb", type=int, default=32, help="largest request body accepted, in MiB")
    p.add_argument(
        "--auto-sessions",
        action="store_true",
        help="create a session on first use of an unknown session id or token (local experiments only)",
    )
    p.add_argument("--model", action="append", help="model id listed by /v1/models (repeatable) (default: ares-gateway)")
    p.add_argument("--public-url", default=None, help="URL agents reach the gateway at, if not http://host:port")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request (paths only, never headers)")
    p.add_argument("--log-level", default="INFO", help="log level (DEBUG, INFO, WARNING, ERROR)")
    p.set_defaults(handler=_cmd_serve)


def _cmd_gc(args: argparse.Namespace) -> int:
    from sandbox import collect_garbage

    report = collect_garbage(args.backend or ("docker", "local"), dry_run=args.dry_run, stale_after=args.stale_after)
    verb = "would remove" if args.dry_run else "removed"
    for name in report.removed:
        print(f"{verb} {name} (owner process is gone)")
    for name in report.kept:
        print(f"kept {name} (owner process is alive)")
    for name in report.unknown:
        print(f"left {name} (owner on another host and no heartbeat seen)")
    for error in report.errors:
        print(f"error: {error}", file=sys.stderr)
    print(f"gc: {len(report.removed)} {verb}, {len(report.kept)} kept, {len(report.unknown)} left alone")
    return 1 if report.errors else 0


def _add_gc_command(sub: Any) -> None:
    p = sub.add_parser("gc", help="remove sandboxes whose owner process is gone (never those of a live process)",
                       description="Remove sandboxes whose owner process is gone (never those of a live process).",
                       formatter_class=HelpFormatter)
    p.add_argument(
        "--backend", action="append", choices=["docker", "local", "daytona"],
        help="backend to clean (repeatable) (default: docker and local)",
    )
    p.add_argument("--dry-run", action="store_true", help="only report what would be removed")
    p.add_argument(
        "--stale-after", type=float, default=60.0,
        help="seconds without heartbeat after which an owner on another host counts as gone",
    )
    p.set_defaults(handler=_cmd_gc)


def _add_run_command(sub: Any) -> None:
    from ares_gateway import run_command

    p = sub.add_parser("run", help="run agents on a dataset's tasks in sandboxes, answered by a policy; rewards and "
                                   "trajectories to --out",
                       description="Run an agent harness on a dataset's tasks in sandboxes; every LLM call is answered "
                                   "by the policy. Rewards, trajectories, turns and logs go to --out.",
                       epilog=run_command.run_epilog(), formatter_class=HelpFormatter)
    run_command.add_run_arguments(p)
    p.set_defaults(handler=run_command.cmd_run)


def _add_demo_command(sub: Any) -> None:
    from ares_gateway import run_command

    p = sub.add_parser("demo", help="the bundled examples with mini-swe-agent, local sandboxes and the oracle policy "
                                    "(no API key, Docker or GPU needed)",
                       description="The bundled example tasks with mini-swe-agent, local sandboxes and the oracle "
                                   "policy (no API key, Docker or GPU needed).",
                       formatter_class=HelpFormatter)
    run_command.add_demo_arguments(p)
    p.set_defaults(handler=run_command.cmd_demo)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ares-gateway", description=_DESCRIPTION, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"ares-gateway {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve_command(sub)
    _add_gc_command(sub)
    _add_run_command(sub)
    _add_demo_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
