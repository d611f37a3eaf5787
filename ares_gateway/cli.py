"""The ``ares-gateway`` command line."""

from __future__ import annotations

import argparse
import sys
from typing import Any


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
    p = sub.add_parser("gc", help="remove sandboxes whose owner process is gone (never those of a live process)")
    p.add_argument(
        "--backend", action="append", choices=["docker", "local", "daytona"],
        help="backend to clean (repeatable; default: docker and local)",
    )
    p.add_argument("--dry-run", action="store_true", help="only report what would be removed")
    p.add_argument(
        "--stale-after", type=float, default=60.0,
        help="seconds without heartbeat after which an owner on another host counts as gone",
    )
    p.set_defaults(handler=_cmd_gc)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ares-gateway", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_gc_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        return 2
    return int(handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
