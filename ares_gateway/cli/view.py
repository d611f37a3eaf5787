"""``ares-gateway view DIR``: the trajectory viewer of a finished run directory (or a data dir), offline."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import secrets
import signal
import sys
from pathlib import Path
from typing import Any

from ares_gateway.cli._support import HelpFormatter
from ares_gateway.core.store import DB_NAME


async def _view(source: Any, host: str, port: int, ready: Any = None) -> None:
    from ares_gateway.viewer import Viewer, serve_viewer

    # Never open, even on 127.0.0.1: any user of this host reaches that port. A token of this process,
    # in the URL's fragment (never sent to a server, never logged; the page drops it from the history).
    token = secrets.token_urlsafe(24)
    viewer = Viewer(source, admin_token=token)
    runner, bound = await serve_viewer(viewer, host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"ares-gateway viewer of {source.title}: http://{host}:{bound}/ui/#token={token} (Ctrl-C stops it)",
          flush=True)
    try:
        await stop.wait()
    finally:
        viewer.close()
        await runner.cleanup()
        source.close()


def cmd_view(args: argparse.Namespace) -> int:
    """``ares-gateway view``: serve the viewer of ``args.dir`` (or ``--data-dir``) until Ctrl-C."""
    from ares_gateway.viewer import RunSource

    data_dir = Path(args.data_dir) if args.data_dir else None
    if args.dir is None and data_dir is None:
        print("ares-gateway view: name a run directory or --data-dir DIR", file=sys.stderr)
        return 2
    path = Path(args.dir) if args.dir is not None else data_dir
    assert path is not None
    if not path.is_dir():
        print(f"ares-gateway view: {path} is not a directory", file=sys.stderr)
        return 2
    if (path / DB_NAME).is_file() and not (path / "episodes.jsonl").exists():
        source = RunSource(data_dir=path, tokenizer=args.tokenizer)  # a data dir alone
    elif (path / "episodes.jsonl").exists() or (path / "results.json").exists():
        source = RunSource(path, data_dir=data_dir, tokenizer=args.tokenizer)
    else:
        source = _atif_source(path, args.tokenizer)
        if source is None:
            print(f"ares-gateway view: {path} is neither a run directory (results.json, "
                  "episodes.jsonl), a data "
                  f"dir ({DB_NAME}) nor a directory of ATIF trajectories (*.json)", file=sys.stderr)
            return 2
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_view(source, args.host, args.port))
    return 0


def _atif_source(path: Path, tokenizer: str | None) -> Any:
    """A directory of ATIF trajectories (an ``export --format atif``, a Harbor job) as a run directory
    in a temporary directory removed at exit; ``None`` when it holds none."""
    import atexit
    import shutil
    import tempfile

    from ares_gateway.episodes.atif import import_atif
    from ares_gateway.viewer import RunSource

    tmp = Path(tempfile.mkdtemp(prefix="ares-atif-view-"))
    atexit.register(shutil.rmtree, tmp, True)
    report = import_atif(path, tmp)
    for line in report.problems:
        print(f"warning: {line}", file=sys.stderr)
    if not report.written:
        return None
    return RunSource(tmp, tokenizer=tokenizer, title=f"{path} (ATIF)")


def add_view_command(sub: Any) -> None:
    """Register ``view`` on the CLI's subparsers."""
    p = sub.add_parser("view",
                       help="browse a run's episodes, turns, message trees and samples in the browser",
                       description="Serve the trajectory viewer of a run directory (or a gateway "
                                   "data dir) on 127.0.0.1 and print its URL (which logs in with a token of "
                                   "this process, in the URL's fragment); read-only, offline "
                                   "(docs/viewer.md).",
                       formatter_class=HelpFormatter)
    p.add_argument("dir", nargs="?", default=None,
                   help="a run's output directory (ares-gateway run --out) or a data dir")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="a gateway data dir: alone, its sessions are the episodes; with a run directory, the "
                        "records its message trees come from (default: DIR/gateway-data)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1: this host only)")
    p.add_argument("--port", type=int, default=8377, help="port; 0 picks a free one (default: 8377)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="a .gguf or Hugging Face directory for the tokens' text (default: the run's model)")
    p.add_argument("--log-level", default="WARNING", help="log level (DEBUG, INFO, WARNING, ERROR)")
    p.set_defaults(handler=cmd_view)
