"""The exec tunnel over Daytona's transports (the toolbox PTY WebSocket, an SSH exec channel) against
the unix-socket relay: latency of a kept-alive agent turn and throughput.

    python3 bench/bench_tunnel_daytona.py [--requests 2000] [--body 2000] [--mib 64]

The same server and stdlib client as bench/bench_tunnel.py.  The Daytona paths are a real
``DaytonaSandbox(network="none", forwards=...)`` driven by the real ``daytona`` SDK against the fake of
bench/support/daytona_fake.py in its own process (as the daemon is another machine): its PTY
WebSocket over a host PTY, or its in-process asyncssh gateway.  The client runs inside the fake's
sandbox (its own network namespace when bwrap is usable).  No network latency is in these numbers:
on Daytona itself each turn adds the round trip to its proxy or SSH gateway.

Prints a table: p50/p99 per turn, added p50/p99 against ``direct``, MB/s down and up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_relay import pct  # noqa: E402
from bench_tunnel import CLIENT, host_client, start_host_side, tunnel_client  # noqa: E402


async def daytona_client(tunnel: str, api_url: str, sock: str, args: argparse.Namespace) -> dict[str, Any]:
    from sandbox import DaytonaSandbox, SandboxSpec

    tmp = tempfile.mkdtemp(prefix="ares-bench-daytona-")
    spec = SandboxSpec(network="none", forwards={18080: sock}, workdir=f"{tmp}/work")
    async with DaytonaSandbox(spec, api_key="fake-daytona-key", api_url=api_url, tunnel=tunnel,
                              relay_dir=f"{tmp}/relay") as sb:
        r = await sb.exec(
            ["python3", "-c", CLIENT, "18080", str(args.requests), str(args.body), str(args.mib)],
            cwd="/", timeout=900)
        if not r.ok:
            raise SystemExit(f"daytona {tunnel} client failed: {r.stderr[-2000:]}")
        tunnel_obj = sb.tunnel_for(18080)
        assert tunnel_obj is not None and tunnel_obj.channels_opened == 1, ("the channel dropped "
                                                                            "during the bench")
        return dict(json.loads(r.stdout))


async def run(args: argparse.Namespace, sock: str, port: int, api_url: str) -> None:
    results: dict[str, dict[str, Any]] = {}
    results["direct"] = await host_client(sock, args)
    results["relay"] = await host_client(str(port), args)
    results["tunnel pipe"] = await tunnel_client("pipe", sock, args)
    for tunnel in ("pty", "ssh"):
        results[f"daytona {tunnel}"] = await daytona_client(tunnel, api_url, sock, args)
    print(f"{args.requests} sequential POSTs of {args.body} bytes on one kept-alive connection (ms); "
          f"{args.mib} MiB down and up (MB/s)")
    print("| path | p50 | p99 | added p50 | added p99 | down MB/s | up MB/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    base = results["direct"]["times"]
    for path, r in results.items():
        t = r["times"]
        added = "- | -" if path == "direct" else \
            f"{(pct(t, .5) - pct(base, .5)) * 1e3:+.3f} | {(pct(t, .99) - pct(base, .99)) * 1e3:+.3f}"
        print(f"| {path} | {pct(t, .5) * 1e3:.3f} | {pct(t, .99) * 1e3:.3f} | {added} | {r['down']:.0f} | "
              f"{r['up']:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--body", type=int, default=2000)
    parser.add_argument("--mib", type=int, default=64, help="MiB downloaded and uploaded once each")
    args = parser.parse_args()
    fake = subprocess.Popen([sys.executable, "-m", "bench.support.daytona_fake"], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert fake.stdout is not None and fake.stdin is not None
    api_url = json.loads(fake.stdout.readline())["api_url"]
    sock, port, procs = start_host_side()
    try:
        try:
            import uvloop  # the gateway's loop
        except ImportError:
            asyncio.run(run(args, sock, port, api_url))
        else:
            uvloop.run(run(args, sock, port, api_url))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        fake.stdin.close()
        fake.wait(20)


if __name__ == "__main__":
    main()
