"""The viewer's parts without a browser: turn views from a file equal those built in memory, the tree's
leaf numbering is the samples' ``branch``, and a mount serves only paths the gateway does not."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from ares_gateway import Gateway
from ares_gateway.viewer.turns import FileTurns, TurnViews
from bench.support.viewer_runs import big_session
from trajectory import TrajectoryManager, TurnRecord


def test_file_turns_equal_turns_built_in_memory(tmp_path: Path) -> None:
    big_session(tmp_path, "t.0", turns=30, turn_kb=60)
    path = tmp_path / "turns" / "t.0.jsonl"
    entries = [json.loads(line) for line in path.read_text().splitlines()]
    # A side call in the middle, and a request that rewrites the history (a fork).
    entries.insert(5, {**entries[0], "side_call": True, "request": {"model": "m", "messages": [
        {"role": "user", "content": "title?"}]}})
    entries.insert(
        9, {**entries[8], "request": {"model": "m", "messages": entries[8]["request"]["messages"][:3]}})
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    memory = TurnViews()
    memory.add(entries)
    on_file = FileTurns(path)
    assert on_file.count() == memory.count() == 32 and on_file.side_count() == memory.side_count() == 1
    for line in ("all", "main", "side"):
        for offset in (0, 7, 30):
            assert on_file.page(offset=offset, limit=5, line=line) == memory.page(offset=offset, limit=5,
                                                                                  line=line)
    views = memory.page(offset=0, limit=40)["turns"]
    assert views[9]["diverged_at"] == 3 and "diverged_at" not in views[10]
    assert [m["role"] for m in views[1]["messages"]] == ["assistant", "tool"]  # only what the turn added


def test_tree_leaves_are_the_samples_branches() -> None:
    tm = TrajectoryManager()
    sys_, user = {"role": "system", "content": "s"}, {"role": "user", "content": "u"}

    def turn(prompt: list[int], out: list[int]) -> TurnRecord:
        return TurnRecord(prompt, out, [-0.1] * len(out))

    a1 = {"role": "assistant", "content": "a1"}
    tm.record_turn("s", prompt_messages=[sys_, user], response_message=a1, turn=turn([1, 2, 3], [4, 5]))
    for i, tail in enumerate(("x", "y", "z")):
        tm.record_turn("s", prompt_messages=[sys_, user, a1, {"role": "user", "content": tail}],
                       response_message={"role": "assistant", "content": f"r{i}"},
                       turn=turn([1, 2, 3, 4, 5, 10 + i], [20 + i]))
    view = tm.tree_view("s")
    assert view is not None and view["leaves"] == 3
    leaves = {n["leaf"]: n["preview"] for n in view["nodes"] if "leaf" in n}
    samples = tm.samples("s")
    assert {s.metadata["branch"]: f"r{s.metadata['turn_ids'][-1] - 2}" for s in samples} == leaves
    assert [n.get("forks") for n in view["nodes"] if n.get("forks")] == [3]
    assert tm.tree_view("s", side_call=True) is None and tm.tree_view("nobody") is None


async def test_mount_serves_only_what_the_gateway_does_not() -> None:
    seen: list[str] = []

    async def ui(request: web.BaseRequest) -> web.StreamResponse:
        seen.append(request.path)
        return web.Response(text="ui")

    async with Gateway(data_dir=False) as gw, aiohttp.ClientSession() as http:
        with pytest.raises(ValueError):
            gw.mount("/v1", ui)
        with pytest.raises(ValueError):
            gw.mount("ui/", ui)
        gw.mount("/ui", ui)  # after start: the route table holds the mounts by reference
        for path in ("/ui", "/ui/", "/ui/api/run"):
            async with http.get(gw.url + path) as resp:
                assert resp.status == 200 and await resp.text() == "ui"
        async with http.get(gw.url + "/uix") as resp:
            assert resp.status == 404
        async with http.get(gw.url + "/healthz") as resp:
            assert resp.status == 200
        assert seen == ["/ui", "/ui/", "/ui/api/run"]
    await asyncio.sleep(0)


async def test_an_open_event_stream_does_not_hold_the_gateway_open() -> None:
    import time

    from ares_gateway.viewer import mount_viewer

    gw = Gateway(data_dir=False)
    mount_viewer(gw)
    await gw.start()
    async with aiohttp.ClientSession() as http:
        resp = await http.get(gw.url + "/ui/api/events",
                              headers={"authorization": f"Bearer {gw.admin_token}"})
        assert resp.status == 200 and resp.headers["content-type"].startswith("text/event-stream")
        assert (await resp.content.readline()) == b"event: run\n"
        t0 = time.monotonic()
        await gw.close()
        assert time.monotonic() - t0 < 2.0  # not the server's 5 s grace for requests in flight
        resp.close()


def test_a_failed_policy_call_shows_its_error() -> None:
    views = TurnViews()
    views.add([
        {"protocol": "openai.chat", "request": {"model": "m", "messages": [{"role": "user", "content": "x"}]},
         "error": {"status": 502, "message": "upstream answered 500: injected"}}])
    assert views.views[0]["answer"] == {"error": {"text": "upstream answered 500: injected"}, "status": 502}


def test_view_refuses_what_it_cannot_show(tmp_path: Path) -> None:
    import subprocess
    import sys

    from .conftest import REPO

    def view(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ares_gateway.cli", "view", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=60, check=False)

    got = view()
    assert got.returncode == 2 and "name a run directory or --data-dir DIR" in got.stderr
    got = view(str(tmp_path))
    assert got.returncode == 2 and "is neither a run directory" in got.stderr
    got = view(str(tmp_path / "missing"))
    assert got.returncode == 2 and "is not a directory" in got.stderr


async def test_the_tree_rebuilt_from_a_turn_log_is_the_recorders() -> None:
    """A run's ``turns/`` file gives the same tree as the live recorder (the run deletes its sessions)."""
    from ares_gateway.core.session_recorder import tree_view_of_turn_log
    from bench.support.viewer_runs import Agent, forked_session

    async with Gateway(data_dir=False) as gw:
        info = await gw.create_session()
        agent = Agent(gw, info)
        await forked_session(agent)
        await agent.client.close()
        log = json.loads(json.dumps(gw.turn_log(info.session_id)))  # as the file holds it
        for side in (False, True):
            live = gw.recorder.tree_view(info.session_id, side_call=side)
            assert live is not None and tree_view_of_turn_log(log, side_call=side) == live
        assert tree_view_of_turn_log(
            [{**t, "completion": {k: v for k, v in t["completion"].items() if k != "tokens"}}
             for t in log]) is None


def test_tree_view_marks_a_merged_rewrite_and_a_realigned_turn() -> None:
    """A client replays the first answer rewritten and re-tokenized: the replay merges into the generated
    node (``rewrites``), and the next turn's tokens drift inside that answer only (``link: replace``)."""
    tm = TrajectoryManager(fork_threshold_tokens=1024)
    sys_, user = {"role": "system", "content": "s"}, {"role": "user", "content": "u"}
    tm.record_turn("s", prompt_messages=[sys_, user], response_message={"role": "assistant", "content": "a1"},
                   turn=TurnRecord([1, 2, 3], [4, 5], [-0.1, -0.1]))
    replayed = {"role": "assistant", "content": "a1 (as the client re-wrote it)"}
    tm.record_turn("s", prompt_messages=[sys_, user, replayed, {"role": "user", "content": "go on"}],
                   response_message={"role": "assistant", "content": "a2"},
                   turn=TurnRecord([1, 2, 3, 4, 6, 7], [8], [-0.2]))
    view = tm.tree_view("s")
    assert view is not None
    first = next(n for n in view["nodes"] if n.get("turn") == 1)
    second = next(n for n in view["nodes"] if n.get("turn") == 2)
    assert first["rewrites"] == [{"turn_id": 1, "replaced": "a1"}] and "forks" not in first
    assert first["preview"] == "a1 (as the client re-wrote it)"
    assert second["link"] == "replace" and second["leaf"] == 0 and view["leaves"] == 1


def test_episode_keys_are_the_names_the_run_gives_its_files(tmp_path: Path) -> None:
    from ares_gateway.episodes.output import EpisodeResult, RunOutputs
    from ares_gateway.viewer.source import file_key

    for task in ("fix-median-bug", "a b/c<d>..é", "x" * 300, ""):
        RunOutputs(tmp_path).episode(EpisodeResult(task=task, attempt=3, reward=0.0, turns=0, duration=0.0,
                                                   exit_reason="completed"), [], [], {})
        assert (tmp_path / "turns" / f"{file_key(task, 3)}.jsonl").is_file(), task


@pytest.mark.parametrize("durable", [True, False])
async def test_turn_log_reader_decodes_only_what_is_new(tmp_path: Path, durable: bool) -> None:
    from ares_gateway.core.session_recorder import TurnLogReader
    from bench.support.viewer_runs import Agent

    async with Gateway(data_dir=str(tmp_path / "data") if durable else False) as gw:
        info = await gw.create_session()
        agent = Agent(gw, info)
        reader = TurnLogReader(gw.recorder, info.session_id)
        messages: list[dict[str, object]] = [{"role": "user", "content": "go"}]
        seen: list[dict[str, object]] = []
        for i in range(5):
            reply = await agent.turn(messages, f"step {i}", side_call=i == 2)
            messages = [*messages, {"role": "assistant", "content": reply},
                        {"role": "user", "content": f"out {i}"}]
            await gw.durable()
            got = reader.new()
            assert len(got) == 1 and got[0]["completion"]["text"] == f"step {i}"
            seen += got
        assert reader.new() == []
        assert seen == gw.turn_log(info.session_id, tokens=False)
        await agent.client.close()
