"""Policy versions: every answered turn carries the version of the weights that sampled it.

Agents are the official openai SDK over loopback; the policy answers in process (``next_request`` /
``respond``), over the control API (``/poll`` / ``/respond``), or is the TITO policy on the SGLang
client against the engine fake at its wire boundary. Versions set mid-session give samples with two
versions; an engine's report wins over the gateway's; none is null, never 0; the record keeps the
version across a restart, and the export, the viewer's data and results.json carry it.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from ares_gateway import Completion, CompletionDelta, EpisodeConfig, Gateway, RunConfig
from ares_gateway.core.broker import ParkedRequest
from ares_gateway.core.errors import InvalidPolicyVersionError, PolicyVersionBackwardsError
from tests.helpers import token_record

ADMIN = "policy-version-admin-token"
AUTH = {"authorization": f"Bearer {ADMIN}"}


async def _ask(base_url: str, token: str, messages: list[dict[str, Any]]) -> str:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=token, max_retries=0)
    try:
        out = await client.chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]
        return out.choices[0].message.content or ""
    finally:
        await client.close()


async def _two_turns(gw: Gateway, sid: str, token: str, base_url: str, *,
                     versions: tuple[int | None, int | None], late: int | None = None) -> None:
    """Two turns of one conversation, the second extending the first's tokens; ``versions``: what the
    gateway is set to before each turn is handed to the policy; ``late``: a version set after the second
    turn was handed over and before it is answered (it must not apply to that turn)."""
    prompts = ([1, 2, 3], [1, 2, 3, 10, 11, 4, 5])
    outputs = ([10, 11], [12, 13, 14])
    history: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    for i in range(2):
        if versions[i] is not None:
            gw.set_policy_version(versions[i])  # type: ignore[arg-type]
        agent = asyncio.create_task(_ask(base_url, token, history))
        req = await gw.next_request(session=sid, timeout=10)
        assert isinstance(req, ParkedRequest)
        if i == 1 and late is not None:
            gw.set_policy_version(late)
        await gw.respond(req.id, Completion(text=f"answer {i}", tokens=token_record(prompts[i], outputs[i])))
        assert await asyncio.wait_for(agent, 10) == f"answer {i}"
        history += [{"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": "go on"}]


async def test_versions_set_mid_session_give_a_sample_with_two_versions(tmp_path: Path) -> None:
    async with Gateway(port=0, admin_token=ADMIN, data_dir=str(tmp_path / "d")) as gw:
        assert gw.policy_version is None
        info = await gw.create_session("mixed")
        # The second turn is handed over at version 2; version 3 set while it is sampled does not apply.
        await _two_turns(gw, info.session_id, info.token, info.base_url, versions=(1, 2), late=3)
        assert gw.policy_version == 3
        log = gw.turn_log("mixed")
        assert [t["policy_version"] for t in log] == [1, 2]
        (sample,) = gw.trajectory("mixed")
        # Turn 1's output sits at [3, 5), turn 2's at [7, 10) of the sample's tokens.
        assert sample.metadata["policy_versions"] == [[3, 5, 1], [7, 10, 2]]
        assert sample.metadata["mixed_versions"] is True
        assert sample.loss_mask.tolist() == [1, 1, 0, 0, 1, 1, 1]
        view = gw.recorder.tree_view("mixed")
        assert view is not None
        assert [n["policy_version"] for n in view["nodes"] if "turn" in n] == [1, 2]


async def test_a_streamed_answer_keeps_the_version_it_was_handed_over_with() -> None:
    async with Gateway(port=0, admin_token=ADMIN, data_dir=False) as gw:
        gw.set_policy_version(4)
        info = await gw.create_session("stream")

        async def agent() -> str:
            client = openai.AsyncOpenAI(base_url=f"{info.base_url}/v1", api_key=info.token, max_retries=0)
            text = ""
            try:
                stream = await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        text += chunk.choices[0].delta.content
            finally:
                await client.close()
            return text

        task = asyncio.create_task(agent())
        req = await gw.next_request(session="stream", timeout=10)
        assert req is not None

        async def answer() -> AsyncIterator[CompletionDelta | Completion]:
            yield CompletionDelta(text="he")
            gw.set_policy_version(5)  # the weights move on mid-stream: this turn was handed over at 4
            yield CompletionDelta(text="llo")
            yield Completion(text="hello", tokens=token_record([1, 2], [3, 4]))

        await gw.respond(req.id, answer())
        assert await asyncio.wait_for(task, 10) == "hello"
        assert [t["policy_version"] for t in gw.turn_log("stream")] == [4]
        (sample,) = gw.trajectory("stream")
        assert sample.metadata["policy_versions"] == [[2, 4, 4]]


async def test_no_version_is_null_never_zero(tmp_path: Path) -> None:
    async with Gateway(port=0, admin_token=ADMIN, data_dir=str(tmp_path / "d")) as gw, \
            aiohttp.ClientSession() as http:
        info = await gw.create_session("none")
        await _two_turns(gw, info.session_id, info.token, info.base_url, versions=(None, None))
        assert [t["policy_version"] for t in gw.turn_log("none")] == [None, None]
        (sample,) = gw.trajectory("none")
        assert sample.metadata["policy_versions"] == [[3, 5, None], [7, 10, None]]
        assert sample.metadata["mixed_versions"] is False
        async with http.get(f"{gw.url}/policy_version", headers=AUTH) as r:
            assert r.status == 200 and await r.json() == {"version": None}
        async with http.get(f"{gw.url}/sessions/none/turns", headers=AUTH) as r:
            assert [t["policy_version"] for t in await r.json()] == [None, None]
        async with http.get(f"{gw.url}/sessions/none/trajectory", headers=AUTH) as r:
            (got,) = await r.json()
            assert got["metadata"]["policy_versions"] == [[3, 5, None], [7, 10, None]]
    # The record itself holds no version key for such a turn (a record without one reads as none).
    from ares_gateway.core.record_codec import Decoder
    from ares_gateway.core.store import StoreReader

    reader = StoreReader(tmp_path / "d")
    try:
        rows, _ = reader.load_turns("none")
        dec = Decoder()
        assert [("pv" in dec.decode(seq, payload)["header"]) for seq, payload in rows] == [False, False]
    finally:
        reader.close()


async def test_set_policy_version_refuses_going_backwards_and_bad_values() -> None:
    async with Gateway(port=0, admin_token=ADMIN, data_dir=False) as gw, aiohttp.ClientSession() as http:
        gw.set_policy_version(0)
        gw.set_policy_version(0)  # the same again: no change
        gw.set_policy_version(4)
        with pytest.raises(PolicyVersionBackwardsError, match="lower than the gateway's current version 4"):
            gw.set_policy_version(3)
        for bad in (-1, True, 1.5, "5", None):
            with pytest.raises(InvalidPolicyVersionError):
                gw.set_policy_version(bad)  # type: ignore[arg-type]
        assert gw.policy_version == 4
        # The control API: the same rules, in its JSON error shape, behind the admin token.
        async with http.post(f"{gw.url}/policy_version", json={"version": 6}) as r:
            assert r.status == 401
        async with http.post(f"{gw.url}/policy_version", json={"version": 6}, headers=AUTH) as r:
            assert r.status == 200 and await r.json() == {"version": 6}
        async with http.get(f"{gw.url}/policy_version", headers=AUTH) as r:
            assert await r.json() == {"version": 6}
        async with http.post(f"{gw.url}/policy_version", json={"version": 5}, headers=AUTH) as r:
            body = await r.json()
            assert r.status == 409 and body["status"] == "error" and body["code"] == 409
            assert "lower than the gateway's current version 6" in body["error"]
        for bad_body in ({"version": "7"}, {"version": -2}, {"version": False}, {"version": None}, {}, [7]):
            async with http.post(f"{gw.url}/policy_version", json=bad_body, headers=AUTH) as r:
                body = await r.json()
                assert r.status == 400 and body["code"] == 400 and "non-negative integer" in body[
                    "error"], bad_body
        async with http.post(f"{gw.url}/policy_version", data=b"{", headers=AUTH) as r:
            assert r.status == 400
        assert gw.policy_version == 6


async def test_respond_carries_the_policys_version(tmp_path: Path) -> None:
    async with Gateway(port=0, admin_token=ADMIN, data_dir=str(tmp_path / "d")) as gw, \
            aiohttp.ClientSession() as http:
        gw.set_policy_version(2)
        info = await gw.create_session("ext")
        agent = asyncio.create_task(_ask(info.base_url, info.token, [{"role": "user", "content": "hi"}]))
        async with http.get(f"{gw.url}/poll", params={"wait": "10", "session": "ext"}, headers=AUTH) as r:
            (item,) = await r.json()
        answer = {"id": item["id"], "completion": {"text": "ok"},
                  "tokens": {"prompt_ids": [1, 2], "output_ids": [3]}}
        for bad in (-1, "5", True, 2.0, [5]):
            async with http.post(f"{gw.url}/respond", json={**answer, "policy_version": bad},
                                 headers=AUTH) as r:
                body = await r.json()
                assert r.status == 400 and "policy_version must be a non-negative integer" in body[
                    "error"], bad
        # Refused answers left the request waiting: the good one lands.
        async with http.post(f"{gw.url}/respond", json={**answer, "policy_version": 5}, headers=AUTH) as r:
            assert r.status == 200, await r.text()
        assert await asyncio.wait_for(agent, 10) == "ok"
        # Without one, a polled answer takes the gateway's version when it was polled.
        agent = asyncio.create_task(_ask(info.base_url, info.token, [{"role": "user", "content": "again"}]))
        async with http.get(f"{gw.url}/poll", params={"wait": "10", "session": "ext"}, headers=AUTH) as r:
            (item,) = await r.json()
        gw.set_policy_version(9)
        async with http.post(f"{gw.url}/respond", json={"id": item["id"], "completion": {"text": "two"}},
                             headers=AUTH) as r:
            assert r.status == 200
        await asyncio.wait_for(agent, 10)
        assert [t["policy_version"] for t in gw.turn_log("ext")] == [5, 2]
        # Going backwards on the gateway is a 409 whatever the answers said.
        async with http.post(f"{gw.url}/policy_version", json={"version": 8}, headers=AUTH) as r:
            assert r.status == 409


def test_the_record_keeps_versions_across_a_restart_and_the_export_carries_them(tmp_path: Path) -> None:
    data = tmp_path / "d"

    async def record() -> list[dict[str, Any]]:
        async with Gateway(port=0, admin_token=ADMIN, data_dir=str(data)) as gw:
            info = await gw.create_session("kept")
            await _two_turns(gw, info.session_id, info.token, info.base_url, versions=(7, 8))
            await gw.end_session("kept", reward=1.0)
            await gw.durable()
            return [s.to_dict() for s in gw.trajectory("kept")]

    async def reopen() -> tuple[list[Any], list[dict[str, Any]]]:
        async with Gateway(port=0, admin_token=ADMIN, data_dir=str(data)) as gw:
            return [t["policy_version"] for t in gw.turn_log("kept")], [s.to_dict()
                                                                        for s in gw.trajectory("kept")]

    before = asyncio.run(record())
    versions, after = asyncio.run(reopen())  # a new gateway on the same data dir: the records read back
    assert versions == [7, 8]
    assert after == before and after[0]["metadata"]["policy_versions"] == [[3, 5, 7], [7, 10, 8]]
    assert after[0]["metadata"]["mixed_versions"] is True
    r = subprocess.run([sys.executable, "-m", "ares_gateway.cli", "export", str(data), "--out",
                        str(tmp_path / "s.jsonl")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    (row,) = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert row["metadata"]["policy_versions"] == [[3, 5, 7], [7, 10, 8]] and row["metadata"]["mixed_versions"]
    pq = pytest.importorskip("pyarrow.parquet")
    r = subprocess.run([sys.executable, "-m", "ares_gateway.cli", "export", str(data), "--format", "parquet",
                        "--out", str(tmp_path / "s.parquet")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    table = pq.read_table(tmp_path / "s.parquet").to_pylist()
    assert table[0]["policy_versions"] == [{"start": 3, "end": 5, "version": 7},
                                           {"start": 7, "end": 10, "version": 8}]
    assert table[0]["mixed_versions"] is True


def test_the_viewer_shows_the_version_of_each_turn_and_sample() -> None:
    from ares_gateway.viewer.samples import SampleSet
    from ares_gateway.viewer.turns import turn_view

    entry = {"request_id": "r", "protocol": "openai.chat", "side_call": False, "timestamp": 1.0,
             "latency": 0.1, "request": {"messages": [{"role": "user", "content": "hi"}]},
             "completion": {"text": "ok", "finish_reason": "stop"}, "policy_version": 3}
    assert turn_view(entry, 1, None)["policy_version"] == 3
    assert turn_view({**entry, "policy_version": None}, 1, None)["policy_version"] is None
    rows = [{"tokens": [1, 2, 3], "response_length": 2, "loss_mask": [1, 1], "logprobs": [-1.0, -1.0],
             "metadata": {"policy_versions": [[1, 3, 4]], "mixed_versions": False}}]
    (summary,) = SampleSet(rows).summaries()
    assert summary["policy_versions"] == [[1, 3, 4]] and summary["mixed_versions"] is False
    page = (Path(__file__).parents[2] / "ares_gateway" / "viewer" / "static" / "viewer.js").read_text()
    assert "policy versions" in page and "policy version: none" in page


# ------------------------------------------------------------------------------ the engine's own report

@pytest.fixture
async def sglang_fake() -> AsyncIterator[tuple[Any, str]]:
    from tests.tito.test_http_engines import serve_fake

    async with serve_fake() as served:
        yield served


async def test_an_engines_reported_version_wins_over_the_gateways(sglang_fake: tuple[Any, str]) -> None:
    from tests.tito.conftest import need_model_files

    need_model_files()
    from ares_gateway.engines.sglang import SGLangEngine
    from ares_gateway.policies import PolicyServer
    from ares_gateway.policies.tito import TitoPolicy
    from ares_gateway.tokens import ChatRenderer, load_tokenizer

    fake, url = sglang_fake
    engine = SGLangEngine(url)
    policy = TitoPolicy(engine, renderer=ChatRenderer(load_tokenizer()), max_tokens=8)
    async with Gateway(port=0, admin_token=ADMIN, data_dir=False) as gw, PolicyServer(gw, policy,
                                                                                      concurrency=2):
        gw.set_policy_version(3)
        info = await gw.create_session("engine")
        # SGLang labels its weights with a string: a decimal one is the version; any other is none.
        for label in ("7", "default", None, "11"):
            fake.weight_version = label
            await asyncio.wait_for(
                _ask(info.base_url, info.token, [{"role": "user", "content": f"hi {label}"}]), 30)
        assert [t["policy_version"] for t in gw.turn_log("engine")] == [7, 3, 3, 11]
        assert [s.metadata["policy_versions"][0][2] for s in gw.trajectory("engine")] == [7, 3, 3, 11]
    await engine.aclose()


# ------------------------------------------------------------------------------ results.json

async def test_results_carry_each_episodes_first_and_last_version(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from ares_gateway.episodes.rollouts import run_rollouts
    from ares_gateway.episodes.tasks import load_dataset
    from ares_gateway.policies import make_policy
    from ares_gateway.policies.scripted import SessionScriptedPolicy

    monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(tmp_path / "sandboxes"))
    task = load_dataset("examples").tasks[0]
    oracle = make_policy("oracle")
    assert isinstance(oracle, SessionScriptedPolicy)
    async with Gateway(port=0, admin_token=ADMIN, data_dir=str(tmp_path / "d")) as gw:
        gw.set_policy_version(1)

        class Bumping(SessionScriptedPolicy):
            """The oracle, with the trainer's weights moving on after each answer."""

            async def __call__(self, request: Any, /) -> Completion:
                out = await oracle(request)
                gw.set_policy_version((gw.policy_version or 0) + 1)
                return out

        bumping = Bumping.__new__(Bumping)
        bumping.__dict__.update(oracle.__dict__)
        out = tmp_path / "run"
        summary = await run_rollouts(
            [task], policy=bumping, gateway=gw, episode=EpisodeConfig("tiny-agent", sandbox="local"),
            run=RunConfig(concurrency=1, out=out, stats_period=0),
        )
    (episode,) = summary.episodes
    assert episode.reward == 1.0 and episode.turns == 2
    assert (episode.first_version, episode.last_version) == (1, 2)
    doc = json.loads((out / "results.json").read_text())
    assert (doc["episodes"][0]["first_version"], doc["episodes"][0]["last_version"]) == (1, 2)
    line = json.loads((out / "episodes.jsonl").read_text().splitlines()[0])
    assert (line["first_version"], line["last_version"]) == (1, 2)
    turns = [json.loads(x) for x in (out / "turns" / f"{task.name}.0.jsonl").read_text().splitlines()]
    assert [t["policy_version"] for t in turns] == [1, 2]
