"""The open-file limit at gateway start: the soft limit raised to the hard one, the connection cap
derived from it, and a warning naming ``ulimit -n`` when a requested cap cannot fit."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

from ares_gateway.http.open_files import check_connections, connection_cap

REPO = Path(__file__).resolve().parents[2]
START = """
import asyncio, json, logging, resource, sys
from ares_gateway import Gateway
logging.basicConfig(level=logging.WARNING)
async def main():
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    kw = {} if sys.argv[1] == "default" else {"max_connections": int(sys.argv[1])}
    async with Gateway(port=0, data_dir=False, **kw) as gw:
        print(json.dumps({"before": before, "after": resource.getrlimit(resource.RLIMIT_NOFILE),
                          "cap": gw._http.max_connections}), flush=True)
asyncio.run(main())
"""


def _start(arg: str, soft: int, hard: int) -> tuple[dict[str, list[int] | int], str]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    p = subprocess.run([sys.executable, "-c", START, arg], cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)},
                       capture_output=True, text=True, timeout=60, preexec_fn=limit, check=False)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def test_start_raises_the_soft_limit_and_the_cap_follows_it() -> None:
    hard = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 8192)
    got, err = _start("default", 256, hard)
    assert got["before"] == [256, hard]
    assert got["after"] == [hard, hard]
    assert got["cap"] == connection_cap(hard) == hard - min(1024, hard // 4)
    assert "ulimit" not in err


def test_a_cap_past_the_hard_limit_is_kept_with_a_warning_naming_ulimit() -> None:
    got, err = _start("4096", 256, 512)
    assert got["after"] == [512, 512]
    assert got["cap"] == 4096  # what was asked for; the warning says it cannot be reached
    assert "max_connections=4096 needs about 4224 open files" in err
    assert "ulimit -n 4224" in err and "--max-connections" in err
    got, err = _start("300", 256, 512)
    assert got["cap"] == 300 and "ulimit" not in err


def test_the_cap_keeps_a_reserve_for_the_rest_of_the_process() -> None:
    assert connection_cap(1024) == 768
    assert connection_cap(20000) == 18976  # 16,384 sessions fit without a flag
    assert connection_cap(4) == 3
    assert check_connections(16384, 20000) is None
    warning = check_connections(16384, 1024)
    assert warning is not None and "ulimit -n 16640" in warning
