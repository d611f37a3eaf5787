"""The exec tunnel (sandbox/tunnel.py) against the unix-socket relay: latency of a kept-alive agent
turn and throughput, per local transport.

    python3 bench/bench_tunnel.py [--requests 2000] [--body 2000] [--mib 64] [--no-docker]

An aiohttp server (its own process) serves a unix socket, as the gateway serves one per session.  A
stdlib client (its own process; inside the container for Docker) sends ``--requests`` sequential
POSTs of ``--body`` bytes on one kept-alive connection (answered with the same size) and times each,
then downloads and uploads ``--mib`` MiB once each.  Paths:

* ``direct``: the client on the unix socket itself;
* ``relay``: the unix-socket relay (``_relay.py --unix``) on the host's 127.0.0.1;
* ``tunnel pipe``, ``tunnel pty``, ``tunnel pty-line``: ``_relay.py --tunnel`` on a pipe / a PTY
  (binary / base64 line mode), served by :class:`sandbox.tunnel.Tunnel` in this process;
* ``docker mount`` / ``docker exec``: a ``network_mode=none`` container of the agents image, the
  client as the agent, reaching the socket through the bind-mounted relay / the exec tunnel.

Prints a table: p50/p99 per turn, added p50/p99 against ``direct`` (``docker exec``: against
``docker mount``), MB/s down and up.  Goal: <= +1 ms p50 over Docker's exec channel and
>= 50 MB/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_relay import _wait_for, pct  # noqa: E402  (the same percentile and readiness wait)

from bench.support.polling import free_port  # noqa: E402
from sandbox.tunnel import Tunnel, pipe_channel, pty_channel  # noqa: E402

RELAY = str(ROOT / "sandbox" / "_relay.py")
IMAGE = "ares-gateway/agents:latest"

SERVER = r"""
import sys
from aiohttp import web
async def echo(request):
    return web.Response(body=await request.read())
async def upload(request):
    n = 0
    async for chunk in request.content.iter_chunked(1 << 20):
        n += len(chunk)
    return web.Response(text=str(n))
async def download(request):
    n = int(request.query["n"])
    resp = web.StreamResponse()
    resp.content_length = n
    await resp.prepare(request)
    chunk = b"x" * (1 << 20)
    while n:
        part = chunk[:min(n, len(chunk))]
        await resp.write(part)
        n -= len(part)
    return resp
app = web.Application(client_max_size=1 << 30)
app.router.add_post("/echo", echo)
app.router.add_post("/upload", upload)
app.router.add_get("/download", download)
web.run_app(app, path=sys.argv[1], print=None, access_log=None)
"""

# Stdlib only: it also runs inside the container.  Prints JSON: per-turn seconds, MB/s down and up.
CLIENT = r"""
import json, socket, sys, time
target, n, body_size, mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def connect():
    if target.startswith("/"):
        s = socket.socket(socket.AF_UNIX); s.connect(target)
    else:
        s = socket.create_connection(("127.0.0.1", int(target)))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s
def response(s):
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            raise SystemExit("connection closed")
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    length = int([l for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")][0].split(b":")[1])
    got = len(rest)
    while got < length:
        chunk = s.recv(1 << 20)
        if not chunk:
            raise SystemExit("connection closed")
        got += len(chunk)
body = b"x" * body_size
req = (b"POST /echo HTTP/1.1\r\nHost: bench\r\nContent-Length: %d\r\n\r\n" % len(body)) + body
s = connect()
times = []
for i in range(n + 50):
    t0 = time.perf_counter()
    s.sendall(req)
    response(s)
    if i >= 50:  # warm-up
        times.append(time.perf_counter() - t0)
size = mib << 20
t0 = time.perf_counter()
s.sendall(b"GET /download?n=%d HTTP/1.1\r\nHost: bench\r\n\r\n" % size)
response(s)
down = size / (time.perf_counter() - t0) / 1e6
chunk = b"y" * (1 << 20)
t0 = time.perf_counter()
s.sendall(b"POST /upload HTTP/1.1\r\nHost: bench\r\nContent-Length: %d\r\n\r\n" % size)
for _ in range(mib):
    s.sendall(chunk)
response(s)
up = size / (time.perf_counter() - t0) / 1e6
print(json.dumps({"times": times, "down": down, "up": up}))
"""  # noqa: E501 (an embedded script, kept as it runs)


async def host_client(target: str, args: argparse.Namespace) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENT, target, str(args.requests),
                                                str(args.body), str(args.mib), stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"client for {target} failed")
    return dict(json.loads(out))


async def tunnel_client(kind: str, sock: str, args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    line = kind == "pty-line"
    argv = [sys.executable, "-I", RELAY, "--listen", f"127.0.0.1:{port}", "--tunnel",
            "line" if line else "binary"]
    if kind == "pipe":
        tunnel = Tunnel(lambda: pipe_channel(argv), sock)
    else:
        tunnel = Tunnel(lambda: pty_channel(["/bin/sh", "-c", "echo noise; exec " + " ".join(argv)]), sock,
                        line=line)
    await tunnel.start()
    try:
        return await host_client(str(port), args)
    finally:
        await tunnel.close()


async def docker_client(mode: str, sock: str, args: argparse.Namespace) -> dict[str, Any]:
    from sandbox import SandboxSpec
    from sandbox.docker import DockerSandbox

    spec = SandboxSpec(image=IMAGE, network="none", forwards={18080: sock})
    async with DockerSandbox(spec, tunnel=mode) as sb:
        r = await sb.exec(
            ["python3", "-c", CLIENT, "18080", str(args.requests), str(args.body), str(args.mib)],
            user="agent", cwd="/", timeout=900)
        if not r.ok:
            raise SystemExit(f"docker {mode} client failed: {r.stderr[-2000:]}")
        return dict(json.loads(r.stdout))


def start_host_side() -> tuple[str, int, list[subprocess.Popen[bytes]]]:
    """The session's server on a unix socket and the relay to it on 127.0.0.1, both ready."""
    tmp = tempfile.mkdtemp(prefix="ares-bench-tunnel-", dir="/tmp")
    os.chmod(tmp, 0o755)
    sock = os.path.join(tmp, "session.sock")
    server = subprocess.Popen([sys.executable, "-c", SERVER, sock])
    _wait_for(sock, server)
    port, ready = free_port(), os.path.join(tmp, "relay.ready")
    relay = subprocess.Popen([sys.executable, "-I", RELAY, "--listen", f"127.0.0.1:{port}", "--unix", sock,
                              "--ready-file", ready], stdout=subprocess.DEVNULL)
    _wait_for(ready, relay)
    return sock, port, [relay, server]


async def run(args: argparse.Namespace, sock: str, port: int) -> None:
    results: dict[str, dict[str, Any]] = {}
    results["direct"] = await host_client(sock, args)
    results["relay"] = await host_client(str(port), args)
    for kind in ("pipe", "pty", "pty-line"):
        results[f"tunnel {kind}"] = await tunnel_client(kind, sock, args)
    if not args.no_docker:
        for mode in ("mount", "exec"):
            results[f"docker {mode}"] = await docker_client(mode, sock, args)
    print(f"{args.requests} sequential POSTs of {args.body} bytes on one kept-alive connection (ms); "
          f"{args.mib} MiB down and up (MB/s)")
    print("| path | p50 | p99 | added p50 | added p99 | down MB/s | up MB/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for path, r in results.items():
        t = r["times"]
        base_name = "docker mount" if path == "docker exec" else "direct"
        if path == "direct":
            added = "- | -"
        else:
            b = results[base_name]["times"]
            added = f"{(pct(t, .5) - pct(b, .5)) * 1e3:+.3f} | {(pct(t, .99) - pct(b, .99)) * 1e3:+.3f}"
        print(f"| {path} | {pct(t, .5) * 1e3:.3f} | {pct(t, .99) * 1e3:.3f} | {added} | {r['down']:.0f} | "
              f"{r['up']:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--body", type=int, default=2000)
    parser.add_argument("--mib", type=int, default=64, help="MiB downloaded and uploaded once each")
    parser.add_argument("--no-docker", action="store_true")
    args = parser.parse_args()
    sock, port, procs = start_host_side()
    try:
        try:
            import uvloop  # the gateway's loop (tests run on it too)
        except ImportError:
            asyncio.run(run(args, sock, port))
        else:
            uvloop.run(run(args, sock, port))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
