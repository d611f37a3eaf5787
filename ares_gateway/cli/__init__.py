"""The ``ares-gateway`` command line: ``serve``, ``run``, ``demo``, ``view``, ``gc``, ``export``, ``prune``,
``reverify`` (``--help`` on each).

One module per command: :mod:`~ares_gateway.cli.serve`, :mod:`~ares_gateway.cli.run` (``run`` and
``demo``), :mod:`~ares_gateway.cli.view`, :mod:`~ares_gateway.cli.gc`, :mod:`~ares_gateway.cli.export`,
:mod:`~ares_gateway.cli.prune`, :mod:`~ares_gateway.cli.reverify`; what they share in
:mod:`~ares_gateway.cli._support`.
``python3 -m ares_gateway.cli`` is the same as ``ares-gateway``.
"""

from __future__ import annotations

import argparse
import logging

from ares_gateway.cli._support import HelpFormatter, version
from ares_gateway.cli.export import add_export_command
from ares_gateway.cli.gc import add_gc_command
from ares_gateway.cli.prune import add_prune_command
from ares_gateway.cli.reverify import add_reverify_command
from ares_gateway.cli.run import add_demo_command, add_run_command
from ares_gateway.cli.serve import add_serve_command
from ares_gateway.cli.view import add_view_command

_DESCRIPTION = (
    "Run real coding-agent CLIs in sandboxes while every LLM call they make goes through the gateway, is "
    "answered by a policy and recorded as training samples. Start with: ares-gateway demo"
)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ares-gateway", description=_DESCRIPTION, formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"ares-gateway {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_command(sub)
    add_gc_command(sub)
    add_export_command(sub)
    add_prune_command(sub)
    add_run_command(sub)
    add_demo_command(sub)
    add_view_command(sub)
    add_reverify_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``ares-gateway`` with ``argv`` (default: the process's arguments); returns the exit code."""
    args = _build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args.handler(args) or 0)


__all__ = ["main", "version"]
