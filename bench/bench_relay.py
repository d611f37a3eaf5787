"""Added latency of the sandbox relay (sandbox/_relay.py) per HTTP request, on loopback.

    python3 bench/bench_relay.py [--requests 2000] [--body 2000]

An aiohttp server (its own process) serves a unix socket, as the gateway serves one per session.
A stdlib client sends sequential requests (a POST of ``--body`` bytes, answered with the same size)
and times each one, on one kept-alive connection and with a new connection per request:

* ``direct``: the client talks to the unix socket itself;
* ``relay``: the client talks to 127.0.0.1:PORT of a relay process on the host;
* ``sandbox``: the client runs *inside* a hardened local sandbox with ``network="none"`` and talks to
  127.0.0.1:PORT there, which ``forward()`` relays to the socket (skipped without bubblewrap+root).

It prints p50/p99 per path and the relay's added p50/p99 against ``direct`` (goal: <= 1 ms at p50).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import sandbox  # noqa: E402
from sandbox.local import bwrap_available  # noqa: E402

SERVER = r"""
import sys
from aiohttp import web
async def echo(request):
    return web.Response(body=await request.read())
app = web.Application()
app.router.add_post("/echo", echo)
web.run_app(app, path=sys.argv[1], print=None, access_log=None)
"""

# Stdlib only: it also runs inside the sandbox.  Prints a JSON list of per-request seconds.
CLIENT = r"""
import json, socket, sys, time
target, n, body_size, keepalive = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
body = b"x" * body_size
req = (b"POST /echo HTTP/1.1\r\nHost: bench\r\nContent-Type: application/octet-stream\r\n"
       b"Content-Length: %d\r\n\r\n" % len(body)) + body
def connect():
    if target.startswith("/"):
        s = socket.socket(socket.AF_UNIX)
        s.connect(target)
    else:
        s = socket.create_connection(("127.0.0.1", int(target)))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s
def one(s):
    s.sendall(req)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            raise SystemExit("connection closed")
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    length = int([l for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")][0].split(b":")[1])
    while len(rest) < length:
        rest += s.recv(65536)
times = []
s = connect() if keepalive else None
for i in range(n + 50):
    t0 = time.perf_counter()
    if not keepalive:
        s = connect()
    one(s)
    if not keepalive:
        s.close()
    if i >= 50:  # warm-up
        times.append(time.perf_counter() - t0)
print(json.dumps(times))
"""  # noqa: E501 (an embedded script, kept as it runs)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_client(target: str, n: int, body: int, keepalive: bool) -> list[float]:
    out = subprocess.run([sys.executable, "-c", CLIENT, target, str(n), str(body), "1" if keepalive else "0"],
                         capture_output=True, text=True, check=True)
    return list(json.loads(out.stdout))


def _wait_for(path: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{proc.args!r} did not start")
        time.sleep(0.02)


def start_host_side(tmp: str, port: int) -> tuple[str, list[subprocess.Popen[bytes]]]:
    """The unix-socket server and a relay to it on 127.0.0.1:port, both ready."""
    sock = os.path.join(tmp, "session.sock")
    server = subprocess.Popen([sys.executable, "-c", SERVER, sock])
    _wait_for(sock, server)
    ready = os.path.join(tmp, "relay.ready")
    relay = subprocess.Popen([sys.executable, "-I", str(ROOT / "sandbox" / "_relay.py"), "--listen",
                              f"127.0.0.1:{port}", "--unix", sock, "--ready-file", ready],
                             stdout=subprocess.DEVNULL)
    _wait_for(ready, relay)
    return sock, [relay, server]


async def in_sandbox(sock: str, n: int, body: int) -> dict[tuple[str, bool], list[float]]:
    results: dict[tuple[str, bool], list[float]] = {}
    spec = sandbox.SandboxSpec(network="none", hardened=True, forwards={8080: sock})
    async with sandbox.LocalSandbox(spec) as sb:
        for keepalive in (True, False):
            r = await sb.exec(["python3", "-c", CLIENT, "8080", str(n), str(body), "1" if keepalive else "0"],
                              user="agent", cwd="/", timeout=600)
            assert r.ok, r
            results[("sandbox", keepalive)] = list(json.loads(r.stdout))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--body", type=int, default=2000)
    parser.add_argument("--port", type=int, default=18555, help="the host relay's port on 127.0.0.1")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="ares-bench-relay-")
    sock, procs = start_host_side(tmp, args.port)
    try:
        results: dict[tuple[str, bool], list[float]] = {}
        for keepalive in (True, False):
            results[("direct", keepalive)] = run_client(sock, args.requests, args.body, keepalive)
            results[("relay", keepalive)] = run_client(str(args.port), args.requests, args.body, keepalive)
        if bwrap_available() and os.geteuid() == 0:
            results.update(asyncio.run(in_sandbox(sock, args.requests, args.body)))
        print(f"{args.requests} sequential POSTs of {args.body} bytes (answered with the same), times in ms")
        print("| path | connection | p50 | p99 | added p50 | added p99 |")
        print("| --- | --- | --- | --- | --- | --- |")
        for (path, keepalive), times in results.items():
            base = results[("direct", keepalive)]
            added = "- | -" if path == "direct" else (
                f"{(pct(times, .5) - pct(base, .5)) * 1e3:+.3f} | "
                f"{(pct(times, .99) - pct(base, .99)) * 1e3:+.3f}")
            print(f"| {path} | {'kept alive' if keepalive else 'new per request'} | "
                  f"{pct(times, .5) * 1e3:.3f} | {pct(times, .99) * 1e3:.3f} | {added} |")
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
