"""What every ``ares-gateway`` command shares: the version, the help layout, the event loop."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import secrets
from pathlib import Path
from typing import Any

#: The file, in a run's or a server's data directory, holding the admin token it generated.
ADMIN_TOKEN_FILE = "admin-token"


def version() -> str:
    """The installed package's version (the source tree's, when run from a checkout that is not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _version

    try:
        return _version("ares-gateway")
    except PackageNotFoundError:  # pragma: no cover - run from a source tree without an install
        return "unknown (not installed)"


def refuse_secret_flag(parser: argparse.ArgumentParser, flag: str, instead: str) -> None:
    """Make ``flag`` (a secret's value on the command line) exit 2 with one line saying to do ``instead``.

    A command line is public: every user of the host reads it in ``ps`` and ``/proc/<pid>/cmdline``, so
    a secret is never taken there. The flag is kept, hidden, only to be refused: without it argparse
    would take it as an abbreviation of a longer flag (``--admin-token`` of ``--admin-token-file``) and
    read the secret as that flag's value. The value given is never shown.
    """
    line = (f"ares-gateway: {flag} is not accepted: a command line is visible to every user of this host "
            f"(ps); {instead}")

    class _Refuse(argparse.Action):
        def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                     option_string: str | None = None) -> None:
            import sys

            print(line, file=sys.stderr, flush=True)
            raise SystemExit(2)

    parser.add_argument(flag, nargs="?", action=_Refuse, help=argparse.SUPPRESS)


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


def tune_gc() -> None:
    """Make the garbage collector cheap for a request-heavy server.

    Every turn allocates many short-lived objects (parsed JSON, canonical models,
    futures); with CPython's default thresholds that triggers a young-generation
    collection every 700 allocations and, as recorded turns accumulate, full
    collections that walk every recorded turn: tail latencies of hundreds of
    milliseconds. Freezing what start-up allocated and raising the thresholds
    keeps collections rare and short. Call once, after imports, in a process you
    own (``ares-gateway serve`` and ``run`` do); a trainer embedding the gateway decides for
    its own process.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


def run_on_uvloop(main: Any) -> Any:
    """Run a coroutine on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        return asyncio.run(main)
    return uvloop.run(main)


def write_admin_token(directory: str | os.PathLike[str], token: str | None = None) -> tuple[str, Path]:
    """Write ``token`` (default: a new random one) to ``directory/admin-token``, readable by this user
    only (0600, created so from the start: never world-readable for a moment); returns it and the path.

    The token guards the control API; say the path, never the token, in any output.
    """
    token = token or secrets.token_urlsafe(32)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / ADMIN_TOKEN_FILE
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, path

