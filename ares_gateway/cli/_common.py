"""What every ``ares-gateway`` command shares: the version, the help layout, the event loop."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any


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


def run_on_uvloop(main: Any) -> Any:
    """Run a coroutine on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        return asyncio.run(main)
    return uvloop.run(main)
