"""The turn store gathers a loop iteration's writes into one hand-off and lets a commit wait
briefly for more, and the recorder records a turn after its answer went out. Nothing read or made
durable may miss a turn because of either."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import http_writer
from aiohttp.client_proto import ResponseHandler

from ares_gateway import Completion, Gateway
from ares_gateway.core.store import DB_NAME, TurnStore


def _rows(path: Path) -> list[tuple[str, int]]:
    """The turns in the database, read through a connection of its own (what a restart would see)."""
    db = sqlite3.connect(f"file:{path / DB_NAME}?mode=ro", uri=True)
    try:
        return [
            (r[0], r[1]) for r in db.execute("SELECT session_id, seq FROM turns ORDER BY session_id, seq")
        ]
    finally:
        db.close()


async def _committed(path: Path, count: int, within: float = 5.0) -> None:
    """Wait until ``count`` turns are in the database, or ``within`` seconds have passed."""
    deadline = time.monotonic() + within
    while len(_rows(path)) < count and time.monotonic() < deadline:  # noqa: ASYNC110 -- another thread commits
        await asyncio.sleep(0.02)


async def test_the_writes_of_one_loop_iteration_share_one_commit(tmp_path: Path) -> None:
    store = TurnStore(tmp_path / "d", commit_delay=0)
    try:
        await store.barrier()
        before = store.commits
        for seq in range(1, 21):
            store.put_turn("s", seq, b"R" + bytes([seq]))
            time.sleep(0.002)  # noqa: ASYNC251 -- blocks the loop on purpose, the GIL free for the writer
        await store.barrier()
        assert store.commits - before == 1
        assert _rows(tmp_path / "d") == [("s", seq) for seq in range(1, 21)]
    finally:
        store.close()


@pytest.mark.parametrize("delay", [0.0, 0.3])
async def test_without_a_waiter_a_commit_waits_commit_delay_for_more_writes(
    tmp_path: Path, delay: float
) -> None:
    store = TurnStore(tmp_path / "d", commit_delay=delay)
    try:
        await store.barrier()
        before = store.commits
        store.put_turn("s", 1, b"R1")
        await asyncio.sleep(0.1)  # another loop iteration, well within the delay
        store.put_turn("s", 2, b"R2")
        await _committed(tmp_path / "d", 2)
        assert _rows(tmp_path / "d") == [("s", 1), ("s", 2)]  # committed without anybody waiting
        assert store.commits - before == (1 if delay else 2)
    finally:
        store.close()


async def test_a_barrier_does_not_wait_for_the_commit_delay(tmp_path: Path) -> None:
    store = TurnStore(tmp_path / "d", commit_delay=1.0)
    try:
        await store.barrier()
        store.put_turn("s", 1, b"R1")
        await asyncio.sleep(0.05)  # the writer has it, and waits for more
        store.put_turn("s", 2, b"R2")
        t0 = time.monotonic()
        await store.barrier()
        assert time.monotonic() - t0 < 0.5
        assert _rows(tmp_path / "d") == [("s", 1), ("s", 2)]
    finally:
        store.close()


async def test_flush_and_close_on_the_loop_thread_take_what_the_loop_gathered(tmp_path: Path) -> None:
    store = TurnStore(tmp_path / "d", commit_delay=1.0)
    store.put_turn("s", 1, b"R1")
    t0 = time.monotonic()
    # The loop is blocked in flush(): it cannot hand off at the end of this iteration.
    assert store.flush(timeout=5) and time.monotonic() - t0 < 0.5
    store.put_turn("s", 2, b"R2")
    store.close()  # in the same iteration as the write
    assert _rows(tmp_path / "d") == [("s", 1), ("s", 2)]


async def test_writes_from_other_threads_and_the_loop_all_land(tmp_path: Path) -> None:
    store = TurnStore(tmp_path / "d", commit_delay=0.002)
    try:

        def writer(name: str) -> None:
            for seq in range(1, 301):
                store.put_turn(name, seq, b"R")

        threads = [threading.Thread(target=writer, args=(f"t{i}",)) for i in range(3)]
        for t in threads:
            t.start()
        for seq in range(1, 301):
            store.put_turn("loop", seq, b"R")
            if seq % 7 == 0:
                await asyncio.sleep(0)
        for t in threads:
            await asyncio.to_thread(t.join)
        await store.barrier()
        rows = _rows(tmp_path / "d")
        assert len(rows) == 1200 and len(set(rows)) == 1200
    finally:
        store.close()


# ---------------------------------------------------------------- the recorder, after the answer


async def _one_turn(gw: Gateway, http: aiohttp.ClientSession, info: Any, text: str) -> asyncio.Future[Any]:
    """An agent's request over HTTP, answered in process with ``text``; the agent's call, not awaited."""
    call = asyncio.ensure_future(
        http.post(
            f"{info.base_url}/v1/chat/completions",
            headers={"authorization": f"Bearer {info.token}"},
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        )
    )
    req = await gw.next_request(info.session_id, timeout=10)
    assert req is not None
    await gw.respond(req.id, Completion(text=text))
    return call


async def test_a_turn_is_recorded_after_its_answer_is_sent_and_every_read_sees_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[str] = []
    for name in ("_write", "_writelines"):
        real = getattr(http_writer.StreamWriter, name)

        def spy(self: Any, *a: Any, _real: Any = real, **k: Any) -> Any:
            if not isinstance(self._protocol, ResponseHandler):  # the gateway's writes, not the client's
                events.append("sent")
            return _real(self, *a, **k)

        monkeypatch.setattr(http_writer.StreamWriter, name, spy)
    async with Gateway(data_dir=False) as gw, aiohttp.ClientSession() as http:
        real_record = gw.recorder._record

        def record(turn: Any) -> None:
            events.append("recorded")
            real_record(turn)

        monkeypatch.setattr(gw.recorder, "_record", record)
        info = await gw.create_session()
        call = await _one_turn(gw, http, info, "first")
        # Answered: counted at once; read at once (the read records what waits first).
        assert gw.sessions.get(info.session_id).turns == 1
        log = gw.turn_log(info.session_id, tokens=False)
        assert [e["completion"]["text"] for e in log] == ["first"] and events == ["recorded"]
        resp = await call
        assert (await resp.json())["choices"][0]["message"]["content"] == "first"

        events.clear()
        call = await _one_turn(gw, http, info, "second")
        resp = await call
        await resp.read()
        assert events[:2] == ["sent", "recorded"]  # nobody read: the answer went out first
        assert [e["completion"]["text"] for e in gw.turn_log(info.session_id, tokens=False)] == [
            "first",
            "second",
        ]


async def test_durable_takes_the_turns_still_waiting_to_be_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with Gateway(data_dir=str(tmp_path / "data")) as gw, aiohttp.ClientSession() as http:
        assert gw.store is not None
        waiting_at_barrier: list[int] = []
        real_barrier = gw.store.barrier

        def barrier() -> Any:
            waiting_at_barrier.append(len(gw.recorder._waiting))
            return real_barrier()

        monkeypatch.setattr(gw.store, "barrier", barrier)
        info = await gw.create_session()
        call = await _one_turn(gw, http, info, "kept")
        await gw.durable()
        assert waiting_at_barrier == [0]
        assert _rows(tmp_path / "data") == [(info.session_id, 1)]
        (await call).release()


async def test_a_turn_that_fails_to_record_is_logged_and_the_next_records(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async with Gateway(data_dir=False) as gw, aiohttp.ClientSession() as http:
        real_record = gw.recorder._record
        calls = {"n": 0}

        def record(turn: Any) -> None:
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("recorder bug")
            real_record(turn)

        monkeypatch.setattr(gw.recorder, "_record", record)
        info = await gw.create_session()
        with caplog.at_level(logging.ERROR):
            for text in ("lost", "kept"):
                call = await _one_turn(gw, http, info, text)
                resp = await call
                assert resp.status == 200  # the agent's turn is not broken by the recorder
                resp.release()
        assert "recorder failed for" in caplog.text and "recorder bug" in caplog.text
        assert [e["completion"]["text"] for e in gw.turn_log(info.session_id, tokens=False)] == ["kept"]


# ---------------------------------------------------------------- the turns table's layout


def _turns_sql(path: Path) -> str:
    db = sqlite3.connect(f"file:{path / DB_NAME}?mode=ro", uri=True)
    try:
        return str(db.execute("SELECT sql FROM sqlite_master WHERE name='turns'").fetchone()[0])
    finally:
        db.close()


async def test_records_are_appended_to_a_rowid_table_and_a_rewrite_replaces(tmp_path: Path) -> None:
    store = TurnStore(tmp_path / "d")
    try:
        store.put_turn("b", 1, b"R-b1")
        store.put_turn("a", 1, b"R-a1")
        store.put_turn("a", 1, b"R-a1-again")  # a tombstone's or a retry's rewrite: one row, the last
        await store.barrier()
        assert "WITHOUT ROWID" not in _turns_sql(tmp_path / "d").upper()
        rows, damaged = store.load_turns("a")
        assert rows == [(1, b"R-a1-again")] and damaged == []
    finally:
        store.close()


async def test_a_data_dir_with_the_earlier_without_rowid_table_is_read_and_written(tmp_path: Path) -> None:
    import zlib

    from ares_gateway.core.store import SCHEMA_VERSION

    path = tmp_path / "old"
    path.mkdir(mode=0o700)
    db = sqlite3.connect(path / DB_NAME)
    db.executescript(
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
        "CREATE TABLE sessions (id TEXT PRIMARY KEY, token TEXT NOT NULL, created_at REAL NOT NULL, "
        "metadata BLOB NOT NULL, ended INTEGER NOT NULL DEFAULT 0, ended_at REAL, reward REAL, truncated "
        "INTEGER NOT NULL DEFAULT 0, end_info BLOB);"
        "CREATE TABLE turns (session_id TEXT NOT NULL, seq INTEGER NOT NULL, payload BLOB NOT NULL,"
        " crc INTEGER NOT NULL, PRIMARY KEY (session_id, seq)) WITHOUT ROWID;"
    )
    db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
    db.execute("INSERT INTO turns VALUES ('s', 1, ?, ?)", (b"R-old", zlib.crc32(b"R-old")))
    db.commit()
    db.close()
    (path / DB_NAME).chmod(0o600)
    store = TurnStore(path)
    try:
        store.put_turn("s", 2, b"R-new")
        await store.barrier()
        assert store.load_turns("s") == ([(1, b"R-old"), (2, b"R-new")], [])
    finally:
        store.close()
    assert "WITHOUT ROWID" in _turns_sql(path).upper()  # left as it was made


# ---------------------------------------------------------------- a loop that ends before its iteration does


def _stopped_loop(work: Any) -> None:
    """Run ``work`` on a loop that stops at the end of that iteration and closes: what it scheduled
    with ``call_soon`` never runs."""
    loop = asyncio.new_event_loop()

    def step() -> None:
        work()
        loop.stop()

    loop.call_soon(step)
    loop.run_forever()
    loop.close()


def test_writes_gathered_by_a_loop_that_ended_go_with_the_next_write(tmp_path: Path) -> None:
    store = TurnStore(tmp_path / "d", commit_delay=0)
    try:
        _stopped_loop(lambda: store.put_turn("s", 1, b"R1"))

        async def next_loop() -> None:
            store.put_turn("s", 2, b"R2")
            await _committed(tmp_path / "d", 2)  # no barrier: the writer commits on its own

        asyncio.run(next_loop())
        assert _rows(tmp_path / "d") == [("s", 1), ("s", 2)]
    finally:
        store.close()


def test_turns_waiting_on_a_loop_that_ended_are_recorded_before_the_next(tmp_path: Path) -> None:
    from ares_gateway.core.canonical import WireProtocol
    from ares_gateway.core.recorder import RecordedTurn
    from ares_gateway.core.session_recorder import SessionRecorder

    def turn(i: int) -> RecordedTurn:
        body = {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]}
        return RecordedTurn(session_id="s", request_id=f"req_{i}", protocol=WireProtocol.OPENAI_CHAT,
                            completion=Completion(text=f"a{i}"), side_call=False, timestamp=0.0, latency=0.0,
                            raw_body=orjson.dumps(body))

    store = TurnStore(tmp_path / "d", commit_delay=0)
    rec = SessionRecorder(store=store, defer=True)
    try:
        _stopped_loop(lambda: rec(turn(1)))

        async def next_loop() -> None:
            rec(turn(2))
            # the loop drains, the writer commits; nobody reads the recorder
            await _committed(tmp_path / "d", 2)

        asyncio.run(next_loop())
        assert _rows(tmp_path / "d") == [("s", 1), ("s", 2)]
        assert [e["completion"]["text"] for e in rec.turn_log("s")] == ["a1", "a2"]
    finally:
        store.close()
