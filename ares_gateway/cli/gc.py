"""``ares-gateway gc``: remove sandboxes whose owner process is gone (:func:`sandbox.collect_garbage`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ares_gateway.cli._common import HelpFormatter
from sandbox import collect_garbage


def cmd_gc(args: argparse.Namespace) -> int:
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


def add_gc_command(sub: Any) -> None:
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
    p.set_defaults(handler=cmd_gc)
