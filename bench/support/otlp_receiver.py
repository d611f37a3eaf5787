"""A stand-in OTLP/HTTP receiver on 127.0.0.1:4318 for measuring the gateway's OpenTelemetry spans: it
accepts every ``POST /v1/traces`` with 200 and counts posts and bytes (``GET /stats``).

    python3 bench/support/otlp_receiver.py &
    OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 python3 bench/bench_gateway.py --agents 64 \\
        --mode inproc --body small --turn-target 3000 --repeat 1 --memory 0
"""

from __future__ import annotations

from aiohttp import web

_seen = {"posts": 0, "bytes": 0}


async def _traces(req: web.Request) -> web.Response:
    body = await req.read()
    _seen["posts"] += 1
    _seen["bytes"] += len(body)
    return web.Response(status=200, content_type="application/x-protobuf", body=b"")


async def _stats(req: web.Request) -> web.Response:
    return web.json_response(_seen)


if __name__ == "__main__":
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.add_routes([web.post("/v1/traces", _traces), web.get("/stats", _stats)])
    web.run_app(app, host="127.0.0.1", port=4318, print=None)
