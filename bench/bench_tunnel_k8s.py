"""The exec tunnel over the Kubernetes exec WebSocket (sandbox/kubernetes.py), measured as
bench/bench_tunnel.py measures the local transports: latency of a kept-alive agent turn and throughput.

    python3 bench/bench_tunnel_k8s.py [--requests 2000] [--body 2000] [--mib 64]

The session's aiohttp server on a unix socket and bench_tunnel's stdlib client, as there.  The
Kubernetes API is bench/support/kube_fake.py in a process of its own (as an apiserver is), driven by the
real ``kubernetes_asyncio`` client; its pod is a bwrap namespace with no network (needs root, bwrap and
nsenter), where the client runs as ``nobody``.  Paths:

* ``direct``: the client on the unix socket itself;
* ``tunnel pipe``: ``_relay.py --tunnel`` on a pipe (bench_tunnel's reference transport);
* ``k8s exec v5`` / ``k8s exec v4``: the pod's exec tunnel over the exec WebSocket, each subprotocol.

Prints a table: p50/p99 per turn, added p50/p99 against ``direct``, MB/s down and up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_relay import pct  # noqa: E402
from bench_tunnel import CLIENT, host_client, start_host_side, tunnel_client  # noqa: E402

from sandbox import SandboxSpec  # noqa: E402
from sandbox.kubernetes import KubernetesSandbox  # noqa: E402

# The fake API server in its own process: prints its port, serves until stdin ends.
FAKE = r"""
import sys
sys.path.insert(0, sys.argv[1])
from bench.support.kube_fake import KubeFake
fake = KubeFake()
fake.protocols = tuple(sys.argv[2].split(","))
fake.start()
print(fake.port, flush=True)
sys.stdin.read()
fake.stop()
"""


async def k8s_client(protocols: str, sock: str, args: argparse.Namespace) -> dict[str, Any]:
    from bench.support.kube_fake import KubeFake, unavailable

    reason = unavailable()
    if reason:
        raise SystemExit(reason)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", FAKE, str(ROOT), protocols,
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        port = int(await proc.stdout.readline())
        fake = KubeFake()
        fake.port = port
        with tempfile.TemporaryDirectory() as tmp:
            kubeconfig = fake.write_kubeconfig(Path(tmp) / "kubeconfig")
            spec = SandboxSpec(network="none", forwards={18080: sock})
            async with KubernetesSandbox(spec, kubeconfig=kubeconfig, namespace="bench",
                                         default_image="bench") as sb:
                r = await sb.exec(
                    ["python3", "-c", CLIENT, "18080", str(args.requests), str(args.body), str(args.mib)],
                    user="nobody", cwd="/", timeout=900)
                if not r.ok:
                    raise SystemExit(f"k8s client failed: {r.stderr[-2000:]}")
                return dict(json.loads(r.stdout))
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        await asyncio.wait_for(proc.wait(), 30)


async def run(args: argparse.Namespace, sock: str) -> None:
    results: dict[str, dict[str, Any]] = {}
    results["direct"] = await host_client(sock, args)
    results["tunnel pipe"] = await tunnel_client("pipe", sock, args)
    results["k8s exec v5"] = await k8s_client("v5.channel.k8s.io,v4.channel.k8s.io", sock, args)
    results["k8s exec v4"] = await k8s_client("v4.channel.k8s.io", sock, args)
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
    sock, _port, procs = start_host_side()
    try:
        try:
            import uvloop  # the gateway's loop
        except ImportError:
            asyncio.run(run(args, sock))
        else:
            uvloop.run(run(args, sock))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
