"""What the gateway benches share: a free loopback port, a process's resident memory, and the policy
side of ``/poll`` + ``/respond`` that answers every request with "ok" (a trainer's poller at its
cheapest)."""

from __future__ import annotations

import asyncio
import socket

import orjson


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_kib(pid: int) -> int:
    """A process's resident memory (``VmRSS``), in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def answer_polls(url: str, admin_token: str, *, canonical: str = "1", max_items: int = 1024) -> None:
    """Until killed: ``GET /poll`` (long-poll, up to ``max_items`` at once), then one ``POST /respond``
    answering every request with "ok". Prints ``ready`` once its client is up."""
    import aiohttp
    import uvloop

    async def main() -> None:
        headers = {"authorization": f"Bearer {admin_token}"}
        async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None)) as s:
            print("ready", flush=True)
            while True:
                async with s.get(f"{url}/poll",
                                 params={"wait": "30", "max": str(max_items), "canonical": canonical}) as r:
                    items = orjson.loads(await r.read())
                if not items:  # only a non-blocking /poll (the Go proxy's) comes back empty: back off
                    await asyncio.sleep(0.001)
                    continue
                payload = [{"id": it["id"], "completion": {"text": "ok"}} for it in items]
                async with s.post(f"{url}/respond", data=orjson.dumps(payload),
                                  headers={"content-type": "application/json"}) as r:
                    await r.read()

    uvloop.run(main())
