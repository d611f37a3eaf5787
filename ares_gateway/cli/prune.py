"""``ares-gateway prune DIR``: delete ended sessions from a data dir (the gateway using it must be
stopped)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ares_gateway.cli._support import HelpFormatter
from ares_gateway.core.errors import DataDirError
from ares_gateway.core.store import TurnStore


def cmd_prune(args: argparse.Namespace) -> int:
    if args.older_than_days is None and not args.session:
        print("ares-gateway prune: give --older-than-days N (ended sessions) and/or --session ID",
              file=sys.stderr)
        return 2
    try:
        # Takes the data dir's lock: a running gateway keeps its sessions in memory, so pruning
        # under it would be undone or confuse it.
        store = TurnStore(args.dir, min_free_bytes=0)
    except DataDirError as exc:
        print(f"ares-gateway prune: {exc}", file=sys.stderr)
        return 2
    with store:
        before = None if args.older_than_days is None else time.time() - args.older_than_days * 86400.0
        gone = store.prune(ended_before=before, session_ids=args.session or ())
        if gone and args.vacuum:
            store.vacuum()
    print(f"pruned {len(gone)} session(s) from {store.path}" + (f": {', '.join(gone)}" if gone else ""))
    return 0


def add_prune_command(sub: Any) -> None:
    p = sub.add_parser("prune", help="delete ended sessions from a data dir",
                       description="Delete sessions from a gateway data dir: those that ended more "
                                   "than N days ago, and any named ones. Stop the gateway using "
                                   "the dir first.",
                       formatter_class=HelpFormatter)
    p.add_argument("dir", help="the data dir (serve --data-dir)")
    p.add_argument("--older-than-days", type=float, default=None, metavar="N",
                   help="delete sessions that ended more than N days ago (0: every ended session)")
    p.add_argument("--session", action="append", metavar="ID", help="delete this session (repeatable)")
    p.add_argument("--vacuum", action="store_true", help="give the freed space back to the file system")
    p.set_defaults(handler=cmd_prune)
