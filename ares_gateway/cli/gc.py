"""``ares-gateway gc``: remove sandboxes whose owner process is gone (:func:`sandbox.collect_garbage`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ares_gateway.cli._support import HelpFormatter
from sandbox import BACKENDS, collect_garbage


def cmd_gc(args: argparse.Namespace) -> int:
    backends = args.backend or ("docker", "local")
    if args.ray:
        return _gc_on_ray(args, tuple(backends))
    report = collect_garbage(backends, dry_run=args.dry_run, stale_after=args.stale_after)
    return _print_report(report, dry_run=args.dry_run)


def _print_report(report: Any, *, dry_run: bool, where: str = "") -> int:
    verb = "would remove" if dry_run else "removed"
    for name in report.removed:
        print(f"{verb} {name} (owner process is gone)")
    for name in report.kept:
        print(f"kept {name} (owner process is alive)")
    for name in report.unknown:
        print(f"left {name} (owner on another host and no heartbeat seen)")
    for error in report.errors:
        print(f"error: {error}", file=sys.stderr)
    print(
        f"gc{where}: {len(report.removed)} {verb}, {len(report.kept)} kept, {len(report.unknown)} left alone")
    return 1 if report.errors else 0


def _gc_on_ray(args: argparse.Namespace, backends: tuple[str, ...]) -> int:
    """``gc --ray``: the same collection on every alive node of a Ray cluster (what a dead driver's
    gateway actors left there)."""
    import asyncio

    from ares_gateway.extras import MissingExtraError

    try:
        from ares_gateway.episodes.ray import _ray, collect_on_nodes

        ray = _ray()
    except MissingExtraError as exc:
        print(f"ares-gateway: error: gc --ray: {exc}", file=sys.stderr)
        return 2
    from ares_gateway.episodes.ray import CONNECT_TIMEOUT, ClusterUnreachableError, check_cluster_reachable

    try:  # bounded: Ray's own connect loop retries an address that does not answer for many minutes
        check_cluster_reachable(args.ray, CONNECT_TIMEOUT)
    except ClusterUnreachableError as exc:
        print(f"ares-gateway: error: gc --ray: {exc}", file=sys.stderr)
        return 2
    try:
        ray.init(address=args.ray, logging_level="ERROR", log_to_driver=False)
    except Exception as exc:
        print(f"ares-gateway: error: gc --ray: cannot connect to the Ray cluster at {args.ray}: {exc}",
              file=sys.stderr)
        return 2
    try:
        alive = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
        reports = asyncio.run(collect_on_nodes(alive, backends=backends, dry_run=args.dry_run))
    finally:
        ray.shutdown()
    rc = 0
    for node in alive:
        if node not in reports:
            print(f"error: node {node[:12]} could not be reached", file=sys.stderr)
            rc = 1
            continue
        rc = max(rc, _print_report(reports[node], dry_run=args.dry_run, where=f" on node {node[:12]}"))
    return rc


def add_gc_command(sub: Any) -> None:
    p = sub.add_parser("gc",
                       help="remove sandboxes whose owner process is gone (never those of a live process)",
                       description="Remove sandboxes whose owner process is gone (never those of a "
                                   "live process).",
                       formatter_class=HelpFormatter)
    p.add_argument(
        "--backend", action="append", choices=list(BACKENDS),
        help="backend to clean (repeatable) (default: docker and local)",
    )
    p.add_argument("--dry-run", action="store_true", help="only report what would be removed")
    p.add_argument(
        "--stale-after", type=float, default=60.0,
        help="seconds without heartbeat after which an owner on another host counts as gone",
    )
    p.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                   help="collect on every alive node of a Ray cluster (auto, or its address), e.g. "
                        "after a driver of ares-gateway run --ray died")
    p.set_defaults(handler=cmd_gc)
