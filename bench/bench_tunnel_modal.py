"""The exec tunnel over a Modal-shaped process (sandbox/modal.py's channel) against a plain pipe and the
unix socket itself: p50/p99 of a kept-alive ~2 KB POST turn and MB/s, as bench/bench_tunnel.py measures.

    python3 bench/bench_tunnel_modal.py [--requests 2000] [--body 2000] [--mib 64]

``modal stand-in``: ``ModalSandbox`` adopting bench/support/modal_fake.py's stand-in (a bwrap network
namespace, needs root); the client runs inside it by ``sb.exec`` and reaches the session through
``sb.forward`` (the relay on a long-lived exec, its stdin/stdout behind the ContainerProcess surface).
``modal sdk+router``: the same through the SDK's own exec path and ``ContainerProcess`` (gRPC to a
stand-in task command router on 127.0.0.1, bench/support/modal_router_fake.py).  Modal's network
between the host and its worker is in neither number.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from bench_relay import pct
from bench_tunnel import CLIENT, ROOT, host_client, start_host_side, tunnel_client

sys.path.insert(0, str(ROOT))

from bench.support.modal_fake import FakeModalSandbox
from bench.support.modal_router_fake import RouterModalSandbox, RouterStandIn
from sandbox import SandboxSpec
from sandbox.modal import ModalSandbox


async def modal_client(sock: str, args: argparse.Namespace, *, via: str) -> dict[str, Any]:
    fake = FakeModalSandbox()
    await fake.start()
    handle: Any = fake
    if via == "sdk":
        router = RouterStandIn(fake)  # type: ignore[abstract]
        await router.start()
        handle = RouterModalSandbox(fake, router)
    async with ModalSandbox(SandboxSpec(network="none", forwards={18080: sock}), sandbox=handle) as sb:
        r = await sb.exec(
            ["python3", "-c", CLIENT, "18080", str(args.requests), str(args.body), str(args.mib)],
            cwd="/", timeout=900)
        if not r.ok:
            raise SystemExit(f"modal client failed: {r.stderr[-2000:]}")
        return dict(json.loads(r.stdout))


async def run(args: argparse.Namespace, sock: str) -> None:
    results = {"direct": await host_client(sock, args),
               "tunnel pipe": await tunnel_client("pipe", sock, args),
               "modal stand-in": await modal_client(sock, args, via="stand-in"),
               "modal sdk+router": await modal_client(sock, args, via="sdk")}
    print(f"{args.requests} sequential POSTs of {args.body} bytes on one kept-alive connection (ms); "
          f"{args.mib} MiB down and up (MB/s)")
    print("| path | p50 | p99 | added p50 vs direct | down MB/s | up MB/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    base = results["direct"]["times"]
    for path, r in results.items():
        t = r["times"]
        print(f"| {path} | {pct(t, .5) * 1e3:.3f} | {pct(t, .99) * 1e3:.3f} | "
              f"{(pct(t, .5) - pct(base, .5)) * 1e3:+.3f} | {r['down']:.0f} | {r['up']:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--body", type=int, default=2000)
    parser.add_argument("--mib", type=int, default=64)
    args = parser.parse_args()
    sock, _port, procs = start_host_side()
    try:
        import uvloop

        uvloop.run(run(args, sock))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
