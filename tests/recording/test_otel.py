"""OpenTelemetry spans (the ``otel`` extra): a span per LLM call with OpenInference's LLM attributes, a span
per episode as its parent, message contents only when asked.

Spans are checked with the SDK's own ``InMemorySpanExporter`` on real turns (the official openai SDK over
loopback, answered in process) and on a real tiny-agent episode in a local sandbox (the oracle policy with
token records); token counts equal the turn log's ``usage``. Export is checked over OTLP/HTTP, configured
only by ``OTEL_EXPORTER_OTLP_ENDPOINT``: the receiver is an aiohttp server on 127.0.0.1 accepting
``POST /v1/traces`` and decoding the body with opentelemetry-proto's ``ExportTraceServiceRequest`` (the
wire format the SDK's exporter sends; no collector installs here).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from tests.helpers import free_port, start_serve, wait_serving

pytest.importorskip("opentelemetry.sdk.trace",
                    reason="the otel extra is not installed: pip install -e '.[otel]'")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http",
                    reason="the otel extra is not installed: pip install -e '.[otel]'")

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ares_gateway import (
    Completion,
    Gateway,
    RolloutSource,
    RunConfig,
    Telemetry,
    TelemetryUnavailableError,
    Usage,
)
from ares_gateway.episodes.config import EpisodeConfig
from ares_gateway.episodes.driver import EpisodeSpec, drive_episode
from ares_gateway.episodes.tasks import load_dataset
from tests.rollouts.test_stream import TokenOracle

SECRET = "sk-do-not-export-me"


def _memory(record_content: bool = False) -> tuple[Telemetry, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Telemetry(tracer_provider=provider, record_content=record_content), exporter


async def _two_turns(gw: Gateway, sid: str) -> None:
    """Two turns of one conversation from the openai SDK, answered in process (one with ``usage``)."""
    info = await gw.create_session(sid)

    async def agent() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{info.base_url}/v1", api_key=info.token, max_retries=0)
        history: list[Any] = [{"role": "user", "content": f"my key is {SECRET}"}]
        got = []
        try:
            for _ in range(2):
                out = await client.chat.completions.create(model="m", messages=history)
                text = out.choices[0].message.content or ""
                got.append(text)
                history += [{"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
        finally:
            await client.close()
        return got

    task = asyncio.create_task(agent())
    for answer in (Completion(text="one", model="policy-7", usage=Usage(input_tokens=12, output_tokens=3)),
                   Completion(text="two", model="policy-7")):
        req = await gw.next_request(session=sid, timeout=10)
        await asyncio.sleep(0.05)
        await gw.respond(req.id, answer)
    assert await asyncio.wait_for(task, 20) == ["one", "two"]


@pytest.mark.parametrize("record_content", [False, True])
async def test_a_span_per_llm_call_with_openinference_attributes(record_content: bool) -> None:
    telemetry, exporter = _memory(record_content)
    async with Gateway(port=0, data_dir=False, telemetry=telemetry) as gw:
        await _two_turns(gw, "otel-serve")
        log = gw.turn_log("otel-serve")
    spans = sorted(exporter.get_finished_spans(), key=lambda s: s.start_time or 0)
    assert len(spans) == 2 == len(log)
    for span, turn in zip(spans, log, strict=True):
        a = dict(span.attributes or {})
        assert span.name == "llm.call" and span.parent is None  # no episode: a root span naming its session
        assert a["openinference.span.kind"] == "LLM"
        assert a["llm.model_name"] == "policy-7"
        assert a["ares.session_id"] == "otel-serve" and a["ares.request_id"] == turn["request_id"]
        # Latency is the span itself: the request's arrival to its answer's end, as the turn log says.
        assert span.start_time == int(turn["timestamp"] * 1e9)
        assert span.end_time is not None
        assert abs((span.end_time - span.start_time) / 1e9 - turn["latency"]) < 1e-3
        assert turn["latency"] >= 0.05 * 0.9
        assert abs(a["ares.parked_seconds"] - turn["usage"]["parked_seconds"]) < 1e-5  # the log rounds to µs
        assert abs(a["ares.policy_seconds"] - turn["usage"]["policy_seconds"]) < 1e-5
        if record_content:
            assert SECRET in a["input.value"] and json.loads(a["input.value"])["model"] == "m"
            assert json.loads(a["output.value"])["content"] == turn["completion"]["text"]
        else:
            assert not any(k.startswith(("input.", "output.")) for k in a)
            assert all(SECRET not in str(v) for v in a.values())
    first, second = (dict(s.attributes or {}) for s in spans)
    assert (first["llm.token_count.prompt"], first["llm.token_count.completion"],
            first["llm.token_count.total"]) == (
        log[0]["usage"]["prompt_tokens"], log[0]["usage"]["completion_tokens"], 15) == (12, 3, 15)
    # Counts not known (no token record, no usage): left out, never 0.
    assert log[1]["usage"]["prompt_tokens"] is None and "llm.token_count.prompt" not in second


async def test_an_episode_span_parents_its_llm_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(tmp_path / "sandboxes"))
    task = load_dataset("examples").tasks[0]
    telemetry, exporter = _memory()
    spec = EpisodeSpec(task=task, attempt=0, episode=EpisodeConfig("tiny-agent", sandbox="local"))
    async with Gateway(port=0, data_dir=False, telemetry=telemetry) as gw:
        record = await asyncio.wait_for(drive_episode(spec, policy=TokenOracle(), gateway=gw), 50)
    spans = exporter.get_finished_spans()
    episodes = [s for s in spans if s.name.startswith("episode ")]
    calls = sorted((s for s in spans if s.name == "llm.call"), key=lambda s: s.start_time or 0)
    assert len(episodes) == 1
    ep = episodes[0]
    a = dict(ep.attributes or {})
    r = record.result
    assert (a["ares.task"], a["ares.attempt"], a["ares.harness"]) == (task.name, 0, "tiny-agent")
    assert a["ares.reward"] == r.reward == 1.0 and a["ares.exit_reason"] == r.exit_reason
    assert a["ares.turns"] == r.turns == len(calls) >= 2 and a["ares.session_id"] == r.session_id
    for span, turn in zip(calls, record.turns, strict=True):
        assert span.parent is not None and span.parent.span_id == ep.context.span_id
        assert span.context.trace_id == ep.context.trace_id
        assert ep.start_time is not None and ep.end_time is not None and span.start_time is not None
        assert ep.start_time <= span.start_time and (span.end_time or 0) <= ep.end_time
        s = dict(span.attributes or {})
        use = turn["usage"]
        assert (s["llm.token_count.prompt"], s["llm.token_count.completion"]) == (
            use["prompt_tokens"], use["completion_tokens"]) == (
            len(turn["completion"]["tokens"]["prompt_ids"]), len(turn["completion"]["tokens"]["output_ids"]))
        assert s["llm.token_count.total"] == use["prompt_tokens"] + use["completion_tokens"]
        assert s["ares.session_id"] == r.session_id
        assert not any(k.startswith(("input.", "output.")) for k in s)


async def _receiver(received: list[ExportTraceServiceRequest]) -> tuple[web.AppRunner, int]:
    """An OTLP/HTTP trace receiver on loopback: each POST /v1/traces body decoded as the protobuf request."""

    async def traces(request: web.Request) -> web.Response:
        if request.content_type != "application/x-protobuf":
            return web.Response(status=415)
        msg = ExportTraceServiceRequest()
        msg.ParseFromString(await request.read())
        received.append(msg)
        return web.Response(status=200, content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


async def test_spans_reach_an_otlp_http_receiver_configured_by_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    received: list[ExportTraceServiceRequest] = []
    runner, port = await _receiver(received)
    try:
        for name in ("OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                     "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("OTEL_SERVICE_NAME", "ares-otel-test")
        async with Gateway(port=0, data_dir=False) as gw:  # on: the environment asks for traces
            assert gw.telemetry is not None
            await _two_turns(gw, "otel-wire")
        # close() flushed the batch: the spans are at the receiver.
        spans = [(rs, s) for m in received for rs in m.resource_spans for ss in rs.scope_spans
                 for s in ss.spans]
        assert len(spans) == 2
        for rs, s in spans:
            resource = {kv.key: kv.value.string_value for kv in rs.resource.attributes}
            assert resource["service.name"] == "ares-otel-test"
            attrs = {kv.key: kv.value for kv in s.attributes}
            assert s.name == "llm.call" and attrs["openinference.span.kind"].string_value == "LLM"
            assert attrs["ares.session_id"].string_value == "otel-wire"
            assert "input.value" not in attrs
        assert sorted(attrs_of["llm.token_count.total"].int_value for attrs_of in (
            {kv.key: kv.value for kv in s.attributes} for _, s in spans)
                      if "llm.token_count.total" in attrs_of) == [15]
    finally:
        await runner.cleanup()


def test_off_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Telemetry.from_env(env={}) is None
    assert Telemetry.from_env(
        env={"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x"}) is None
    assert Telemetry.from_env(
        env={"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x"}) is None
    assert Telemetry.from_env(enabled=False, env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x"}) is None
    on = Telemetry.from_env(env={"OTEL_TRACES_EXPORTER": "console"})
    assert on is not None
    on.shutdown()
    with pytest.raises(TelemetryUnavailableError, match="http/protobuf"):
        Telemetry.from_env(
            env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert Gateway(data_dir=False).telemetry is None


async def test_serve_otel_sends_spans_with_contents_when_asked(tmp_path: Path) -> None:
    received: list[ExportTraceServiceRequest] = []
    runner, otlp = await _receiver(received)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env |= {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp}", "OTEL_BSP_SCHEDULE_DELAY": "100",
            "ARES_GATEWAY_ADMIN_TOKEN": "otel-admin"}
    proc = start_serve("--port", str(port), "--in-memory", "--otel", "--otel-content", env=env,
                       merge_stderr=True)
    url = f"http://127.0.0.1:{port}"
    admin = {"authorization": "Bearer otel-admin"}
    try:
        await wait_serving(url, proc)
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/sessions", json={"session_id": "cli"}, headers=admin) as r:
                info = await r.json()
            client = openai.AsyncOpenAI(base_url=f"{info['base_url']}/v1", api_key=info["token"],
                                        max_retries=0)
            ask = asyncio.create_task(client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"use {SECRET}"}]))
            async with http.get(f"{url}/poll", params={"wait": "10", "session": "cli"}, headers=admin) as r:
                items = await r.json()
            async with http.post(f"{url}/respond",
                                 json={"id": items[0]["id"], "completion": {"text": "done"}},
                                 headers=admin) as r:
                assert r.status == 200, await r.text()
            assert (await asyncio.wait_for(ask, 10)).choices[0].message.content == "done"
            await client.close()
        for _ in range(100):  # the batch goes out within OTEL_BSP_SCHEDULE_DELAY
            if received:
                break
            await asyncio.sleep(0.05)
        spans = [s for m in received for rs in m.resource_spans for ss in rs.scope_spans for s in ss.spans]
        assert len(spans) == 1
        attrs = {kv.key: kv.value.string_value for kv in spans[0].attributes}
        assert attrs["ares.session_id"] == "cli" and SECRET in attrs["input.value"]
        assert json.loads(attrs["output.value"])["content"] == "done"
    finally:
        proc.terminate()
        proc.wait(10)
        await runner.cleanup()


def test_serve_otel_with_an_exporter_not_shipped_says_so() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env |= {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "ARES_GATEWAY_ADMIN_TOKEN": "otel-admin"}
    proc = subprocess.run(
        [sys.executable, "-m", "ares_gateway.cli", "serve", "--port", "0", "--in-memory", "--otel"],
        capture_output=True, text=True, env=env, timeout=30)
    assert proc.returncode == 2, proc.stderr
    assert "http/protobuf" in proc.stderr and "Traceback" not in proc.stderr


async def test_a_run_configured_by_the_environment_sends_episode_and_call_spans(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    received: list[ExportTraceServiceRequest] = []
    runner, otlp = await _receiver(received)
    try:
        for name in [k for k in os.environ if k.startswith("OTEL_")]:
            monkeypatch.delenv(name)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{otlp}")
        monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(tmp_path / "sandboxes"))
        task = load_dataset("examples").tasks[0]
        source = RolloutSource(
            [task], policy=TokenOracle(), episode=EpisodeConfig("tiny-agent", sandbox="local"),
            run=RunConfig(attempts=1, out=tmp_path / "run"),
        )
        groups = [g async for g in source.groups()]
        await source.close()  # closes the run's gateway, which flushes its spans
        assert len(groups) == 1
        spans = [s for m in received for rs in m.resource_spans for ss in rs.scope_spans for s in ss.spans]
        episodes = [s for s in spans if s.name == f"episode {task.name}.0"]
        calls = [s for s in spans if s.name == "llm.call"]
        assert len(episodes) == 1 and len(calls) >= 2
        assert all(c.parent_span_id == episodes[0].span_id and c.trace_id == episodes[0].trace_id
                   for c in calls)
        attrs = {kv.key: kv.value for kv in episodes[0].attributes}
        assert attrs["ares.reward"].double_value == 1.0 and attrs["ares.turns"].int_value == len(calls)
    finally:
        await runner.cleanup()
