"""Records no agent can erase, and a data dir no one else can read.

Each test runs the attack for real: the official SDKs over loopback HTTP, a real tmpfs filled to
the last byte, the real ``ares-gateway serve`` in a subprocess.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import numpy as np
import openai
import pytest

from ares_gateway import Completion, Gateway
from ares_gateway.core.canonical import CanonicalRequest, SamplingParams, WireProtocol
from ares_gateway.core.errors import DataDirError
from ares_gateway.core.recorder import RecordedTurn
from ares_gateway.core.session_recorder import SessionRecorder
from ares_gateway.core.store import TurnStore
from tests.gateway.test_edges import _nested
from tests.helpers import free_port, start_serve, wait_serving

ROOT = os.geteuid() == 0


# ------------------------------------------------------------------------------------- helpers


@contextlib.asynccontextmanager
async def _answering(gw: Gateway, sid: str) -> AsyncIterator[list[str]]:
    """A policy in process answering every request of ``sid`` with a token record; yields the
    request ids it answered."""
    answered: list[str] = []

    async def loop() -> None:
        n = 0
        while True:
            req = await gw.next_request(session=sid, timeout=30)
            if req is None:
                continue
            n += 1
            await gw.respond(req.id, Completion(text=f"answer {n}"),
                             tokens={"prompt_ids": np.arange(10 * n, dtype=np.int32),
                                     "output_ids": np.array([7, 8, 9], dtype=np.int32)})
            answered.append(req.id)

    async with _running(loop()):
        yield answered


@contextlib.asynccontextmanager
async def _running(coro: Coroutine[Any, Any, None]) -> AsyncIterator[None]:
    """``coro`` as a task for the block's length, cancelled and awaited at its end."""
    task = asyncio.ensure_future(coro)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _chat(messages: list[dict[str, Any]], t: int) -> list[dict[str, Any]]:
    return [*messages, {"role": "user", "content": f"turn {t}: " + "x" * 200}]


# ------------------------------------------------------------------------------ numbers, 400


async def test_a_number_no_protocol_allows_is_a_400_in_its_shape_and_erases_nothing(tmp_path: Path) -> None:
    """One ``"max_tokens": 1e308`` (a 309-digit integer the record codec cannot pack, which would
    break the delta base of the turns after it) is a 400 in each protocol's shape, and every
    answered turn survives a restart whole."""
    data = tmp_path / "data"
    async with Gateway(port=0, data_dir=str(data)) as gw:
        info = await gw.create_session("s")
        oa = openai.AsyncOpenAI(base_url=f"{info.base_url}/v1", api_key=info.token, max_retries=0)
        an = anthropic.AsyncAnthropic(base_url=info.base_url, api_key=info.token, max_retries=0)
        bad_chat: list[dict[str, Any]] = [
            {"max_tokens": 1e308}, {"max_completion_tokens": 1e308}, {"max_tokens": 0}, {"max_tokens": -5},
            {"temperature": 1e308}, {"top_p": 1.5}, {"seed": 1e30}, {"n": 10**6}, {"top_k": 1e20},
            {"presence_penalty": 3.0},
        ]
        async with _answering(gw, "s") as answered:
            messages: list[dict[str, Any]] = []
            for t in range(10):
                messages = _chat(messages, t)
                if t == 3:  # the attack, every way: each is refused before anything is parked
                    for extra in bad_chat:
                        with pytest.raises(openai.BadRequestError) as err:
                            await oa.chat.completions.create(model="m", messages=messages,  # type: ignore[arg-type]
                                                             extra_body=extra)
                        body = err.value.body
                        assert isinstance(body, dict) and body.get("type") == "invalid_request_error", body
                        assert body.get("param") == next(iter(extra)), body
                    with pytest.raises(anthropic.BadRequestError) as aerr:
                        await an.messages.create(model="m", max_tokens=1e308, timeout=30,  # type: ignore[arg-type]
                                                 messages=[{"role": "user", "content": "hi"}])
                    assert aerr.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
                    with pytest.raises(anthropic.BadRequestError):
                        await an.messages.create(model="m", max_tokens=10, extra_body={"temperature": 1.5},
                                                 messages=[{"role": "user", "content": "hi"}])
                    with pytest.raises(openai.BadRequestError) as rerr:
                        await oa.responses.create(model="m", input="hi", max_output_tokens=1e308)  # type: ignore[arg-type]
                    assert rerr.value.status_code == 400
                resp = await oa.chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]
                messages.append({"role": "assistant", "content": resp.choices[0].message.content})
            await gw.durable()
            assert len(answered) == 10
        before = gw.turn_log("s")
    async with Gateway(port=0, data_dir=str(data)) as gw:
        log = gw.turn_log("s")
        assert len(log) == 10 and log == before
        assert [t["request"]["messages"][-1]["content"].split(":")[0] + ":"
                for t in log] == [f"turn {t}:" for t in range(10)]
        assert "damaged_records" not in gw.session_summary("s")


# ------------------------------------------------ a body nested too deep to record: 400, nothing erased


@contextlib.asynccontextmanager
async def _answering_over_poll(gw: Gateway) -> AsyncIterator[list[str]]:
    """A policy polling over HTTP for the native body only (``canonical=0``), as the Go proxy's pollers
    do; yields the request ids it answered."""
    answered: list[str] = []

    async def loop(http: aiohttp.ClientSession) -> None:
        while True:
            async with http.get(f"{gw.url}/poll", params={"wait": "5", "canonical": "0"}) as r:
                assert r.status == 200, await r.text()
                items = await r.json()
            if not items:
                continue
            answers = [{"id": it["id"], "completion": {"text": f"answer {len(answered) + i + 1}"}}
                       for i, it in enumerate(items)]
            answered.extend(it["id"] for it in items)  # before the agent has its answer, as in process
            async with http.post(f"{gw.url}/respond", json=answers) as r:
                assert r.status == 200, await r.text()
                assert all(x["status"] == "ok" for x in await r.json())

    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {gw.admin_token}"}) as http, \
            _running(loop(http)):
        yield answered


@pytest.mark.parametrize("policy", ["native-poll", "in-process"])
async def test_a_body_nested_too_deep_to_record_is_a_400_in_its_shape_and_erases_nothing(
        policy: str, tmp_path: Path) -> None:
    """A body nesting 300 levels parses (orjson reads 1,000), but no record of it can be encoded
    (orjson writes 254): a policy that polled the native body (``canonical=0``), or took it in process,
    answered it, and its turn went to the data dir as a tombstone. An agent could hide any turn so.
    Now the body parser refuses it before it is parked, in each protocol's shape and on each of its
    paths: a small body parsed whole, a long session's new message (the parse memo) or changed field
    (decoded whole); a body nested to the limit is recorded as sent."""
    from ares_gateway.core.wire import MAX_JSON_DEPTH

    data = tmp_path / "data"
    async with Gateway(port=0, data_dir=str(data)) as gw:
        info = await gw.create_session("s")
        oa = openai.AsyncOpenAI(base_url=f"{info.base_url}/v1", api_key=info.token, max_retries=0)
        an = anthropic.AsyncAnthropic(base_url=info.base_url, api_key=info.token, max_retries=0)
        answering = _answering_over_poll(gw) if policy == "native-poll" else _answering(gw, "s")
        async with answering as answered:
            # 9 KiB of system prompt: every turn of this conversation goes through the session's parse memo.
            messages: list[dict[str, Any]] = [{"role": "system", "content": "be brief. " * 900}]
            for t in range(10):
                messages = _chat(messages, t)
                if t == 3:
                    refused: list[str] = []
                    attacks: list[tuple[str, list[dict[str, Any]], dict[str, Any]]] = [
                        ("new message", [*messages[:-1], {**messages[-1], "x": _nested(300)}], {}),
                        ("changed field", messages, {"metadata_x": _nested(300)}),
                        ("one level past the limit", messages, {"x": _nested(MAX_JSON_DEPTH)}),
                        ("small body", [{"role": "user", "content": "hi", "x": _nested(300)}], {}),
                    ]
                    for what, msgs, extra in attacks:
                        with pytest.raises(openai.BadRequestError) as err:
                            await oa.chat.completions.create(model="m", messages=msgs,  # type: ignore[arg-type]
                                                             extra_body=extra)
                        body = err.value.body
                        assert isinstance(body, dict) and body.get("type") == "invalid_request_error", (what,
                                                                                                        body)
                        assert "nests objects or arrays too deeply" in body["message"], (what, body)
                        refused.append(what)
                    with pytest.raises(anthropic.BadRequestError) as aerr:
                        await an.messages.create(model="m", max_tokens=10,
                                                 messages=[{"role": "user", "content": "hi"}],
                                                 tools=[{"name": "t", "input_schema": {"type": "object",
                                                                                       "x": _nested(300)}}])
                    assert aerr.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
                    with pytest.raises(openai.BadRequestError) as rerr:
                        await oa.responses.create(model="m", input="hi", extra_body={"x": _nested(300)})
                    assert rerr.value.status_code == 400 and "too deeply" in str(rerr.value)
                    assert len(refused) == 4 and gw.broker.pending_count == 0
                    # At the limit it is taken, answered and recorded.
                    at_limit = await oa.chat.completions.create(model="m", messages=messages,  # type: ignore[arg-type]
                                                                extra_body={"x": _nested(MAX_JSON_DEPTH - 1)})
                    assert at_limit.choices[0].message.content
                resp = await oa.chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]
                messages.append({"role": "assistant", "content": resp.choices[0].message.content})
            await gw.durable()
            assert len(answered) == 11
        before = gw.turn_log("s")
        assert gw.recorder.store is not None and gw.recorder.store.lost_turns == 0
    async with Gateway(port=0, data_dir=str(data)) as gw:
        log = gw.turn_log("s")
        assert len(log) == 11 and log == before
        assert log[3]["request"]["x"] == _nested(MAX_JSON_DEPTH - 1)
        assert [t["request"]["messages"][-1]["content"].split(":")[0] + ":" for t in log
                if "x" not in t["request"]] == [
            f"turn {t}:" for t in range(10)]
        assert "damaged_records" not in gw.session_summary("s")


# --------------------------------------------------------------------- a record that cannot be encoded


def _turn(sid: str, t: int, *, max_tokens: int = 16) -> RecordedTurn:
    body = {"model": "m", "max_tokens": 16,
            "messages": [{"role": "user", "content": f"turn {i}"} for i in range(t + 1)]}
    request = CanonicalRequest(protocol=WireProtocol.ANTHROPIC_MESSAGES, raw=body,
                               sampling=SamplingParams(max_tokens=max_tokens))
    return RecordedTurn(session_id=sid, request_id=f"r{t}", protocol=WireProtocol.ANTHROPIC_MESSAGES,
                        completion=Completion(text=f"a{t}"), side_call=False, timestamp=float(t), latency=0.0,
                        request=request)


def test_a_record_that_cannot_be_encoded_is_a_tombstone_and_the_next_is_whole(tmp_path: Path) -> None:
    """Whatever a turn holds (here a Python caller's integer beyond 64 bits), failing to encode its
    record damages no other turn: the next record is a keyframe, and the lost turn is reported."""
    with TurnStore(tmp_path) as store:
        rec = SessionRecorder(store=store)
        for t in range(10):
            rec(_turn("s", t, max_tokens=10**30 if t == 3 else 16))
        store.flush()
    with TurnStore(tmp_path) as store:
        rec = SessionRecorder(store=store)
        rec.known({"s"})
        log = rec.turn_log("s")
        assert [e["request_id"] for e in log] == [f"r{t}" for t in range(10) if t != 3]
        assert [len(e["request"]["messages"]) for e in log] == [t + 1 for t in range(10) if t != 3]
        (lost,) = rec.damaged["s"]
        assert lost.seq == 4 and lost.reason.startswith("not recorded: it could not be encoded")
        rec(_turn("s", 10))  # the restored session goes on, as a delta against turn 10
        assert [e["request_id"] for e in rec.turn_log("s")][-2:] == ["r9", "r10"]


# ---------------------------------------------------------------------------------- a full disk


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 48 MiB tmpfs (we are root), unmounted afterwards."""
    if not ROOT:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(path: Path) -> None:
    """Write ``path`` until the file system has not a byte left."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (2**20, 4096, 512, 1):
            with contextlib.suppress(OSError):
                while os.write(fd, b"\0" * size) == size:
                    pass
    finally:
        os.close(fd)
    assert os.statvfs(path).f_bavail == 0


async def test_a_full_disk_loses_only_the_turns_answered_while_it_was_full(small_fs: Path) -> None:
    """A batch that fails for a full disk is reported turn by turn (a tombstone each), and every
    turn answered after the space comes back (a delta against the turns before) is whole, through
    a restart."""
    data = small_fs / "data"
    filler = small_fs / "filler"
    async with Gateway(port=0, data_dir=str(data), min_free_mb=1) as gw:
        info = await gw.create_session("s")
        await gw.durable()
        an = anthropic.AsyncAnthropic(base_url=info.base_url, api_key=info.token, max_retries=0)
        messages: list[dict[str, Any]] = []

        async def turn(t: int) -> None:
            nonlocal messages
            messages = [*messages, {"role": "user", "content": f"turn {t}: " + "y" * 4000}]
            resp = await an.messages.create(model="m", max_tokens=64, messages=messages)  # type: ignore[arg-type]
            messages.append({"role": "assistant", "content": resp.content[0].text})  # type: ignore[union-attr]

        async with _answering(gw, "s"):
            for t in range(5):
                await turn(t)
            await gw.durable()
            _fill(filler)
            refused = 0
            for t in range(5, 9):  # answered (the agent gets its answers), not recorded
                await turn(t)
                try:
                    await gw.durable()
                except DataDirError as exc:
                    refused += "full" in str(exc)
            filler.unlink()
            for t in range(9, 15):
                await turn(t)
            await gw.durable()
        before = gw.turn_log("s")
        async with aiohttp.ClientSession() as http, http.get(
                f"http://127.0.0.1:{gw.port}/metrics",
                headers={"Authorization": f"Bearer {gw.admin_token}"}) as r:
            metrics = await r.text()
        assert "ares_gateway_turns_lost_total 4.0" in metrics, metrics
    async with Gateway(port=0, data_dir=str(data), min_free_mb=1) as gw:
        log = gw.turn_log("s")
        kept = [e["request"]["messages"][-1]["content"].split(":")[0] + ":" for e in log]
        assert kept == [f"turn {t}:" for t in (*range(5), *range(9, 15))]
        assert log == [e for e in before if e["request"]["messages"][-1]["content"].split(":")[0]
                       + ":" in kept]
        assert [e["completion"]["tokens"]["output_ids"] for e in log] == [[7, 8, 9]] * len(log)
        damaged = gw.session_summary("s")["damaged_records"]
        assert [d["turn"] for d in damaged] == [6, 7, 8, 9]
        assert all(d["reason"].startswith("not recorded: writing it failed") and "full" in d["reason"]
                   for d in damaged), damaged
    assert refused == 4  # each turn's wait for the disk said so


# ----------------------------------------------------------------------- modes of the data dir


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("ARES_GATEWAY_ADMIN_TOKEN", None)
    return env


def _serve(data_dir: Path, port: int = 0) -> subprocess.Popen[str]:
    """``serve`` as it is run by default: no token file or variable, so it writes one into the data dir."""
    return start_serve("--port", str(port), "--data-dir", str(data_dir), env=_env())


async def _serve_and_stop(data_dir: Path, port: int) -> str:
    """``serve`` on ``data_dir`` until it answers, then stopped: what it wrote to stderr."""
    proc = _serve(data_dir, port)
    try:
        await wait_serving(f"http://127.0.0.1:{port}", proc)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    return err


async def _a_session_with_a_turn(url: str, data: Path, sid: str = "s") -> dict[str, Any]:
    admin = {"authorization": f"Bearer {(data / 'admin-token').read_text().strip()}"}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/sessions", json={"session_id": sid}, headers=admin) as r:
            info: dict[str, Any] = await r.json()
        post = asyncio.ensure_future(http.post(
            f"{url}/s/{sid}/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            headers={"authorization": f"Bearer {info['token']}"}))
        async with http.get(f"{url}/poll", params={"wait": "10", "session": sid}, headers=admin) as r:
            (item,) = await r.json()
        async with http.post(f"{url}/respond", json={"id": item["id"], "completion": {"text": "ok"}},
                             headers=admin) as r:
            assert r.status == 200, await r.text()
        (await post).release()
    return info


def _modes(d: Path) -> dict[str, str]:
    return {p.name: oct(stat.S_IMODE(p.lstat().st_mode)) for p in d.iterdir()}


async def test_the_data_dir_is_0700_and_every_file_in_it_0600(tmp_path: Path) -> None:
    """``serve`` makes the data dir 0700 and SQLite's -wal and -shm 0600, so no other local user reads
    live session tokens from the WAL. Checked while the gateway runs, the WAL holding a session."""
    old = os.umask(0o022)  # the usual umask, whatever the test runner's
    try:
        data = tmp_path / "fresh" / "data"
        port = free_port()
        proc = _serve(data, port)
    finally:
        os.umask(old)
    try:
        await wait_serving(f"http://127.0.0.1:{port}", proc)
        info = await _a_session_with_a_turn(f"http://127.0.0.1:{port}", data)
        assert info["token"].encode() in (data / "gateway.sqlite3-wal").read_bytes()  # what is at stake
        assert oct(stat.S_IMODE(data.stat().st_mode)) == "0o700"
        modes = _modes(data)
        assert {"gateway.sqlite3", "gateway.sqlite3-wal", "gateway.sqlite3-shm", "lock",
                "admin-token"} <= modes.keys()
        assert set(modes.values()) == {"0o600"}, modes
    finally:
        proc.terminate()
        proc.wait(20)
    # An existing data dir others could read is made private, with a warning.
    os.chmod(data, 0o755)
    os.chmod(data / "gateway.sqlite3", 0o644)
    proc = _serve(data, port)
    try:
        await wait_serving(f"http://127.0.0.1:{port}", proc)
        assert oct(stat.S_IMODE(data.stat().st_mode)) == "0o700"
        assert set(_modes(data).values()) == {"0o600"}, _modes(data)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    assert "made 0700" in err and "made 0600" in err, err


# --------------------------------------------------------------------- unusable data dirs, one line


def _start_fails(data: Path) -> str:
    """``serve`` on ``data`` (as run by default: it writes its admin token there) exits 2 with one
    line on stderr and no traceback; returns the line."""
    try:
        r = subprocess.run(
            [sys.executable, "-m", "ares_gateway.cli", "serve", "--port", "0", "--data-dir", str(data)],
            capture_output=True, text=True, timeout=30, env=_env(),
        )
    except subprocess.TimeoutExpired:
        raise AssertionError(f"serve started on {data}") from None
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    assert lines[0].startswith("ares-gateway: "), lines
    return lines[0]


def _gateway_db(data: Path, sessions: list[tuple[str, str]]) -> None:
    """A data dir as a stopped gateway leaves it, with these (id, token) sessions."""
    with TurnStore(data) as store:
        for sid, token in sessions:
            store.put_session(sid, token, 1.0, {})
        store.flush()


def test_symlinks_in_the_data_dir_are_refused_never_followed(tmp_path: Path) -> None:
    """The lock file and the database are never opened through symlinks (which would truncate the
    lock's target and overwrite it with a pid, and chmod the database's)."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    os.chmod(victim, 0o644)
    data = tmp_path / "d1"
    data.mkdir(mode=0o700)
    (data / "lock").symlink_to(victim)
    assert "lock is a symbolic link" in _start_fails(data)
    assert victim.read_text() == "precious\n"
    data = tmp_path / "d2"
    data.mkdir(mode=0o700)
    (data / "gateway.sqlite3").symlink_to(victim)
    assert "gateway.sqlite3 is a symbolic link" in _start_fails(data)
    assert victim.read_text() == "precious\n" and stat.S_IMODE(victim.stat().st_mode) == 0o644
    data = tmp_path / "d3"
    _gateway_db(data, [])
    (data / "gateway.sqlite3-wal").unlink(missing_ok=True)
    (data / "gateway.sqlite3-wal").symlink_to(victim)
    assert "gateway.sqlite3-wal is a symbolic link" in _start_fails(data)
    assert victim.read_text() == "precious\n"


def test_every_unusable_data_dir_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """Each is one line and exit 2, never a traceback, and a foreign database is left unaltered."""
    (tmp_path / "a-file").write_text("x")
    assert "a file of that name" in _start_fails(tmp_path / "a-file")

    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    db = sqlite3.connect(foreign / "gateway.sqlite3")
    db.execute("CREATE TABLE sessions (name TEXT, owner TEXT)")
    db.execute("INSERT INTO sessions VALUES ('mine', 'someone')")
    db.commit()
    db.close()
    before = (foreign / "gateway.sqlite3").read_bytes()
    assert "is not a gateway database" in _start_fails(foreign)
    assert (foreign / "gateway.sqlite3").read_bytes() == before  # not altered

    for value in ("not-a-number", "2"):
        d = tmp_path / f"schema-{value}"
        _gateway_db(d, [])
        db = sqlite3.connect(d / "gateway.sqlite3")
        db.execute("UPDATE meta SET value=? WHERE key='schema'", (value,))
        db.commit()
        db.close()
        assert "schema version" in _start_fails(d)

    dup = tmp_path / "dup"
    _gateway_db(dup, [("a", "the-same-token-for-two"), ("b", "the-same-token-for-two")])
    assert "have the same token" in _start_fails(dup)

    if ROOT:  # a read-only file system (a chmod does not stop root)
        ro = tmp_path / "ro"
        ro.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(ro)], check=True)
        try:
            assert "cannot create data dir" in _start_fails(ro / "data")
            assert "Read-only file system" in _start_fails(ro)
        finally:
            subprocess.run(["umount", "-l", str(ro)], check=False)


async def test_a_discarded_wal_is_reported(tmp_path: Path) -> None:
    """A WAL full of garbage is not discarded in silence: one warning line names what SQLite
    discards, and a copy of the WAL is kept."""
    data = tmp_path / "data"
    port = free_port()
    proc = _serve(data, port)
    try:
        await wait_serving(f"http://127.0.0.1:{port}", proc)
        await _a_session_with_a_turn(f"http://127.0.0.1:{port}", data)
        proc.send_signal(signal.SIGKILL)  # the session is in the WAL only
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    wal = data / "gateway.sqlite3-wal"
    size = wal.stat().st_size
    assert size > 0
    # A WAL as a killed gateway leaves it is no garbage: a copy of the data dir starts with its
    # session, and nothing is reported.
    import shutil

    intact = tmp_path / "intact"
    shutil.copytree(data, intact)
    err = await _serve_and_stop(intact, port)
    assert "(1 session(s) known)" in err and "WARNING" not in err, err
    garbage = os.urandom(size)
    wal.write_bytes(garbage)
    err = await _serve_and_stop(data, port)
    warned = [line for line in err.splitlines() if "WARNING" in line and "-wal" in line]
    assert len(warned) == 1 and "not a SQLite WAL" in warned[0] and "discard" in warned[0], err
    (copy,) = data.glob("gateway.sqlite3-wal.discarded-*")
    assert copy.read_bytes() == garbage and stat.S_IMODE(copy.stat().st_mode) == 0o600


def test_a_torn_wal_tail_is_named_and_an_intact_wal_is_not(tmp_path: Path) -> None:
    """:func:`inspect_wal` against SQLite's own WAL: intact, nothing to report; the last commit cut
    short (a torn write, or damage), its frames are named."""
    from ares_gateway.core.store import inspect_wal

    db = sqlite3.connect(tmp_path / "x.sqlite3")
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE t (v BLOB)")
    for i in range(5):
        with db:
            db.execute("INSERT INTO t VALUES (?)", (os.urandom(3000 + i),))
    wal = (tmp_path / "x.sqlite3-wal").read_bytes()
    db.close()
    (tmp_path / "w").write_bytes(wal)
    assert inspect_wal(tmp_path / "w") is None
    assert inspect_wal(tmp_path / "absent") is None
    (tmp_path / "w").write_bytes(wal[:-100])
    torn = inspect_wal(tmp_path / "w")
    assert torn is not None and "after the last commit" in torn
    damaged = bytearray(wal)
    damaged[len(wal) - 2000] ^= 0xFF
    (tmp_path / "w").write_bytes(bytes(damaged))
    assert "after the last commit" in (inspect_wal(tmp_path / "w") or "")
    (tmp_path / "w").write_bytes(b"\0" * 10)
    assert "too short" in (inspect_wal(tmp_path / "w") or "")


def test_a_record_queued_against_one_that_is_then_lost_is_never_written_as_a_delta(tmp_path: Path) -> None:
    """The race inside a failed write: turn 3 is queued and its commit fails, turn 4 (a delta against
    3) was encoded before anyone knew. Turn 4 must not reach the database as a delta (undecodable);
    both are tombstones, the barrier says so, and turn 5 on is whole. The failure is one commit that
    raises SQLite's disk-full error (the full-disk test above does it for real, without the race)."""
    import threading

    class FailOnce(TurnStore):
        fail = threading.Event()

        def _apply(self, batch: list[tuple[Any, ...]]) -> None:
            if self.fail.is_set() and any(op[0] == "turn" for op in batch):
                self.fail.clear()
                raise sqlite3.OperationalError("database or disk is full")
            super()._apply(batch)

    async def main() -> None:
        with FailOnce(tmp_path) as store:
            rec = SessionRecorder(store=store)
            for t in range(2):
                rec(_turn("s", t))
            store.flush()
            store.fail.set()
            with store._db_lock:  # the writer takes turn 3 and waits here; turn 4 is queued behind it
                rec(_turn("s", 2))
                await asyncio.sleep(0.2)
                rec(_turn("s", 3))
                waited = store.barrier()  # queued behind turn 4: it must not say turn 4 is committed
            with pytest.raises(DataDirError, match="continued one that was lost"):
                await waited
            for t in range(4, 7):
                rec(_turn("s", t))
            await store.barrier()
        with TurnStore(tmp_path) as store:
            rec = SessionRecorder(store=store)
            rec.known({"s"})
            assert [e["request_id"] for e in rec.turn_log("s")] == ["r0", "r1", "r4", "r5", "r6"]
            assert [(d.seq, d.reason) for d in rec.damaged["s"]] == [
                (3, "not recorded: writing it failed (database or disk is full)"),
                (4, "not recorded: it continues turn 3, which was lost"),
            ]

    asyncio.run(main())
