"""``ares-gateway reverify DIR``: grade a run's saved workspaces again, each in a fresh sandbox, and set
each reward beside the one recorded (:mod:`ares_gateway.episodes.reverify`).

Exit status: 0 when every episode that was graded in the run reproduced its reward; 1 when any differs
or could not be graded again (each says why); 2 when DIR is no run directory or an option is wrong.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ares_gateway.cli._support import HelpFormatter, run_on_uvloop


def cmd_reverify(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ares_gateway.episodes.reverify import (
        REPORT_FILE,
        RunDirError,
        differing_details,
        report_table,
        reverify_run,
        summary_line,
    )

    if args.concurrency < 1:
        print(f"ares-gateway reverify: --concurrency must be at least 1, got {args.concurrency}",
              file=sys.stderr)
        return 2
    console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200)
    try:
        report = run_on_uvloop(reverify_run(args.dir, sandbox=args.sandbox, concurrency=args.concurrency,
                                            image=args.image, tasks=args.tasks))
    except (RunDirError, ValueError) as exc:
        print(f"ares-gateway reverify: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ares-gateway reverify: interrupted", file=sys.stderr)
        return 130
    for note in report.notes:
        console.print(f"note: {note}", markup=False)
    console.print(report_table(report))
    for line in differing_details(report):
        console.print(line, markup=False)
    console.print(summary_line(report) + f"; report: {args.dir.rstrip('/')}/{REPORT_FILE}", markup=False)
    return report.exit_code


def add_reverify_command(sub: Any) -> None:
    p = sub.add_parser(
        "reverify", help="grade a run's saved workspaces again in fresh sandboxes and compare the rewards",
        description="For each episode of a run directory, start a fresh sandbox from the task's image, copy "
                    "in only the episode's saved workspace (DIR/workspaces/TASK.ATTEMPT.tar), run the task's "
                    "tests and set the reward beside the one recorded, saying what differs (the reward's "
                    "parts, the verifier's output). Writes DIR/reverify.json. Exit status: 0 when every "
                    "graded episode agrees; 1 when any differs or could not be graded again; 2 when DIR is "
                    "no run directory.",
        formatter_class=HelpFormatter)
    p.add_argument("dir", help="a run's output directory (ares-gateway run --out DIR)")
    p.add_argument("--sandbox", choices=("auto", "local", "docker"), default=None,
                   help="where the tests run again (default: the backend the run used, else auto)")
    p.add_argument("--concurrency", "-n", type=int, default=4, metavar="N", help="sandboxes at once")
    p.add_argument("--image", default=None,
                   help="the image for tasks that bring none (default: the run's, else the backend's "
                        "default)")
    p.add_argument("--tasks", default=None, metavar="DATASET",
                   help="a dataset name or directory where tasks are looked up by name when the directory "
                        "the run recorded is gone (default: the run's preset's dataset)")
    p.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.set_defaults(handler=cmd_reverify)
