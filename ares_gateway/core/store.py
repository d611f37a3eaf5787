"""The durable turn store: every answered turn and every session, in one SQLite file in a data dir.

Layout of a data directory::

    DIR/gateway.sqlite3        sessions + turns (SQLite, WAL mode)
    DIR/gateway.sqlite3-wal    SQLite's write-ahead log
    DIR/lock                   held with flock() by the one gateway using DIR (its pid inside)

Why SQLite: it is in the standard library, one file, crash-safe by design (a torn write at the
end of the WAL is ignored on open), and readable by any tool (``sqlite3 DIR/gateway.sqlite3``).

**Writes** happen on one writer thread: the event loop only encodes a turn and puts it on a queue;
the thread commits whatever has queued up in one transaction (many turns of many sessions share a
commit under load). :meth:`TurnStore.barrier` is a future that is done once everything queued
before it is committed; ``respond`` awaits it, so a 200 from ``/respond`` (or a returned
``Gateway.respond``) means the turn is in the database.

**fsync policy**: ``journal_mode=WAL`` with ``synchronous=NORMAL``. A commit is a ``write()`` into
the WAL (the OS page cache), without fsync; the WAL is fsynced at checkpoints. A committed turn
therefore survives the gateway process dying in any way (``kill -9``, OOM kill, a crash); only a
power loss or kernel crash may lose the last commits (never corrupting older ones).
``synchronous="FULL"`` (a constructor argument) fsyncs every commit instead.

**Integrity**: each turn's payload carries a CRC-32. A record that fails it (a damaged disk block,
a file edited by hand) is skipped and reported by :meth:`TurnStore.load_turns`; the rest loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import queue
import shutil
import sqlite3
import threading
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from ares_gateway.core.errors import DataDirError

log = logging.getLogger(__name__)

DB_NAME = "gateway.sqlite3"
LOCK_NAME = "lock"
SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    token TEXT NOT NULL,
    created_at REAL NOT NULL,
    metadata BLOB NOT NULL,
    ended INTEGER NOT NULL DEFAULT 0,
    ended_at REAL,
    reward REAL,
    truncated INTEGER NOT NULL DEFAULT 0,
    end_info BLOB
);
CREATE TABLE IF NOT EXISTS turns (
    session_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    payload BLOB NOT NULL,
    crc INTEGER NOT NULL,
    PRIMARY KEY (session_id, seq)
) WITHOUT ROWID;
"""


@dataclass(frozen=True, slots=True)
class StoredSession:
    """A session as the data dir remembers it."""

    id: str
    token: str
    created_at: float
    metadata: dict[str, Any]
    ended: bool
    ended_at: float | None
    reward: float | None
    truncated: bool
    end_info: dict[str, Any]
    turns: int


@dataclass(frozen=True, slots=True)
class DamagedRecord:
    """A turn record that could not be read back (its CRC or its encoding is wrong)."""

    session_id: str
    seq: int
    reason: str


class _Barrier:
    __slots__ = ("future", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.future: asyncio.Future[None] = loop.create_future()


def _resolve(fut: asyncio.Future[None], error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


def check_data_dir(path: Path, *, min_free_bytes: int) -> None:
    """Raise :class:`DataDirError` unless ``path`` is (or can be made) a writable directory with room."""
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise DataDirError(f"cannot create data dir {path}: {exc.strerror or exc}; pass a writable --data-dir") from None
    if not path.is_dir():
        raise DataDirError(f"data dir {path} is not a directory; pass a directory as --data-dir")
    probe = path / f".probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"x" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise DataDirError(
            f"data dir {path} is not writable ({exc.strerror or exc}); fix its permissions, free space, "
            "or pass another --data-dir"
        ) from None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    free = shutil.disk_usage(path).free
    if free < min_free_bytes:
        raise DataDirError(
            f"data dir {path} has {free // 2**20} MiB free, less than the {min_free_bytes // 2**20} MiB required "
            "(min_free_bytes): free space or pass another --data-dir"
        )


class _Reads:
    """The read side, shared by :class:`TurnStore` and :class:`StoreReader` (loop thread)."""

    _db: sqlite3.Connection
    _db_lock: threading.Lock

    def flush(self, timeout: float = 30.0) -> bool:
        return True


    def _read(self, sql: str, params: Iterable[Any] = ()) -> list[Any]:
        with self._db_lock:
            return self._db.execute(sql, tuple(params)).fetchall()

    def load_sessions(self) -> list[StoredSession]:
        """Every session in the data dir, oldest first, with its number of recorded turns."""
        self.flush()
        rows = self._read(
            "SELECT s.id, s.token, s.created_at, s.metadata, s.ended, s.ended_at, s.reward, s.truncated, s.end_info, "
            "(SELECT COUNT(*) FROM turns t WHERE t.session_id = s.id) FROM sessions s ORDER BY s.created_at"
        )
        out = []
        for sid, token, created, meta, ended, ended_at, reward, truncated, info, turns in rows:
            out.append(
                StoredSession(
                    id=sid,
                    token=token,
                    created_at=created,
                    metadata=_json_obj(meta),
                    ended=bool(ended),
                    ended_at=ended_at,
                    reward=reward,
                    truncated=bool(truncated),
                    end_info=_json_obj(info),
                    turns=int(turns),
                )
            )
        return out

    def load_turns(self, sid: str) -> tuple[list[tuple[int, bytes]], list[DamagedRecord]]:
        """A session's turn payloads in order, and the records that failed their CRC (skipped)."""
        self.flush()
        good: list[tuple[int, bytes]] = []
        damaged: list[DamagedRecord] = []
        for seq, payload, crc in self._read(
            # As a blob whatever the column holds: a row edited by hand into text is damaged, not fatal.
            "SELECT seq, CAST(payload AS BLOB), crc FROM turns WHERE session_id=? ORDER BY seq", (sid,)
        ):
            data = bytes(payload) if payload is not None else b""
            if zlib.crc32(data) != crc:
                damaged.append(DamagedRecord(sid, int(seq), "checksum mismatch (the record is damaged or truncated)"))
                continue
            good.append((int(seq), data))
        return good, damaged

    def session_ids(self) -> list[str]:
        return [r[0] for r in self._read("SELECT id FROM sessions ORDER BY created_at")]


class TurnStore(_Reads):
    """Sessions and encoded turns in ``DIR/gateway.sqlite3``; one gateway per directory (a lock file).

    Args:
        path: the data directory (created with mode 0700 if missing).
        min_free_bytes: refuse to start with less free space than this in ``path``.
        synchronous: SQLite's ``synchronous`` pragma: ``"NORMAL"`` (default; see the module
            docstring) or ``"FULL"`` (an fsync per commit).
        max_batch: most queued writes committed in one transaction.
        cache_kib: SQLite's page cache for the connection, in KiB (memory the gateway holds).

    Raises :class:`DataDirError` when the directory is not writable, is too full, is locked by
    another gateway, or holds a file that is not a gateway database.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        min_free_bytes: int = 64 * 2**20,
        synchronous: str = "NORMAL",
        max_batch: int = 512,
        cache_kib: int = 512,
    ) -> None:
        if synchronous.upper() not in ("NORMAL", "FULL"):
            raise ValueError('synchronous must be "NORMAL" or "FULL"')
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if cache_kib < 64:
            raise ValueError("cache_kib must be >= 64")
        self.cache_kib = cache_kib
        self.path = Path(path).expanduser().resolve()
        self.max_batch = max_batch
        check_data_dir(self.path, min_free_bytes=min_free_bytes)
        self._lock_fd = self._take_lock()
        try:
            self._db = self._connect(synchronous.upper())
        except BaseException:
            self._release_lock()
            raise
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending = 0  # writes queued and not yet committed (read on the loop thread)
        self._pending_lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        #: The first write error since start (disk full, I/O error); later writes keep trying.
        self.error: BaseException | None = None
        self.commits = 0
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="ares-turn-store", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ opening

    def _take_lock(self) -> int:
        lock_path = self.path / LOCK_NAME
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            finally:
                os.close(fd)
            raise DataDirError(
                f"data dir {self.path} is in use by another gateway (pid {holder}): stop that one, or give "
                "this one another --data-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        return fd

    def _release_lock(self) -> None:
        fd, self._lock_fd = self._lock_fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _connect(self, synchronous: str) -> sqlite3.Connection:
        db_path = self.path / DB_NAME
        try:
            # The connection is opened here and then used only by the writer thread, or by the
            # loop thread while the writer is idle under _db_lock: never by both at once.
            db = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(f"PRAGMA synchronous={synchronous}")
            # SQLite's own page cache is gateway memory; appends touch a few pages, reads are rare,
            # and the OS caches the file anyway.
            db.execute(f"PRAGMA cache_size=-{int(self.cache_kib)}")
            db.executescript(_SCHEMA)
            row = db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
            if row is None:
                db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) != SCHEMA_VERSION:
                raise DataDirError(
                    f"{db_path} has schema version {row[0]}; this gateway reads version {SCHEMA_VERSION}"
                )
        except sqlite3.DatabaseError as exc:
            raise DataDirError(
                f"{db_path} cannot be used as a gateway database ({exc}); move it away or pass another --data-dir"
            ) from None
        os.chmod(db_path, 0o600)  # it holds session tokens
        self._db_lock = threading.Lock()
        return db

    # ------------------------------------------------------------------ writes (any thread -> writer)

    def _put(self, op: tuple[Any, ...]) -> None:
        if self._closed:
            raise DataDirError("the turn store is closed")
        with self._pending_lock:
            self._pending += 1
            self._idle.clear()
        self._queue.put(op)

    def put_session(self, sid: str, token: str, created_at: float, metadata: dict[str, Any]) -> None:
        self._put(("session", sid, token, created_at, orjson.dumps(metadata, default=str)))

    def end_session(
        self, sid: str, *, reward: float | None, truncated: bool, end_info: dict[str, Any], ended_at: float
    ) -> None:
        self._put(("end", sid, reward, int(truncated), orjson.dumps(end_info, default=str), ended_at))

    def delete_session(self, sid: str) -> None:
        self._put(("delete", sid))

    def put_turn(self, sid: str, seq: int, payload: bytes) -> None:
        self._put(("turn", sid, seq, payload, zlib.crc32(payload)))

    def barrier(self) -> asyncio.Future[None]:
        """A future done once every write queued before this call is committed (or failed)."""
        b = _Barrier(asyncio.get_running_loop())
        if self._pending == 0 and self.error is None:
            b.future.set_result(None)
            return b.future
        self._put(("barrier", b))
        return b.future

    def flush(self, timeout: float = 30.0) -> bool:
        """Block until every queued write is committed; False if that took longer than ``timeout``."""
        return self._idle.wait(timeout)

    # ------------------------------------------------------------------ the writer thread

    def _write_loop(self) -> None:
        while True:
            op = self._queue.get()
            if op is None:
                return
            batch = [op]
            while len(batch) < self.max_batch:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)  # stop after this batch
                    break
                batch.append(nxt)
            error: BaseException | None = None
            with self._db_lock:
                try:
                    self._apply(batch)
                    self.commits += 1
                except (sqlite3.Error, OSError) as exc:
                    error = exc
                    with contextlib.suppress(sqlite3.Error):
                        self._db.execute("ROLLBACK")
                    if self.error is None:
                        log.error("turn store %s: a write failed and was lost: %s", self.path, exc)
                    self.error = exc
            for item in batch:
                if item[0] == "barrier":
                    b: _Barrier = item[1]
                    err = None if error is None else DataDirError(f"recording to {self.path} failed: {error}")
                    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                        b.loop.call_soon_threadsafe(_resolve, b.future, err)
            with self._pending_lock:
                self._pending -= len(batch)
                if self._pending == 0:
                    self._idle.set()

    def _apply(self, batch: list[tuple[Any, ...]]) -> None:
        db = self._db
        db.execute("BEGIN")
        for op in batch:
            kind = op[0]
            if kind == "turn":
                db.execute("INSERT OR REPLACE INTO turns VALUES (?, ?, ?, ?)", op[1:])
            elif kind == "session":
                db.execute(
                    "INSERT OR REPLACE INTO sessions (id, token, created_at, metadata) VALUES (?, ?, ?, ?)", op[1:]
                )
            elif kind == "end":
                sid, reward, truncated, info, ended_at = op[1:]
                db.execute(
                    "UPDATE sessions SET ended=1, reward=?, truncated=?, end_info=?, ended_at=? WHERE id=?",
                    (reward, truncated, info, ended_at, sid),
                )
            elif kind == "delete":
                db.execute("DELETE FROM turns WHERE session_id=?", (op[1],))
                db.execute("DELETE FROM sessions WHERE id=?", (op[1],))
        db.execute("COMMIT")

    def prune(self, *, ended_before: float | None = None, session_ids: Iterable[str] = ()) -> list[str]:
        """Delete ended sessions that ended before ``ended_before`` (a time.time()), and the given
        sessions; returns the ids deleted. Runs on the caller's thread after the queue drained."""
        self.flush()
        ids = set(session_ids)
        if ended_before is not None:
            ids.update(
                r[0]
                for r in self._read("SELECT id FROM sessions WHERE ended=1 AND ended_at < ?", (ended_before,))
            )
        with self._db_lock:
            self._db.execute("BEGIN")
            for sid in ids:
                self._db.execute("DELETE FROM turns WHERE session_id=?", (sid,))
                self._db.execute("DELETE FROM sessions WHERE id=?", (sid,))
            self._db.execute("COMMIT")
        return sorted(ids)

    def vacuum(self) -> None:
        """Give the space of deleted records back to the file system (rewrites the file)."""
        self.flush()
        with self._db_lock:
            self._db.execute("VACUUM")

    def close(self) -> None:
        """Commit what is queued, stop the writer, checkpoint the WAL and release the lock (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._writer.join(timeout=60)
        with self._db_lock, contextlib.suppress(sqlite3.Error):
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._db.close()
        self._release_lock()

    def __enter__(self) -> TurnStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StoreReader(_Reads):
    """A data dir opened read-only (no lock: works beside a running gateway), for export and inspection.

    Has the read side of :class:`TurnStore` (``load_sessions``, ``load_turns``, ``session_ids``).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).expanduser().resolve()
        db_path = self.path / DB_NAME
        if not db_path.is_file():
            raise DataDirError(f"{self.path} is not a gateway data dir (no {DB_NAME} in it)")
        try:
            self._db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, check_same_thread=False)
            self._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
        except sqlite3.DatabaseError as exc:
            raise DataDirError(f"{db_path} cannot be read as a gateway database ({exc})") from None
        self._db_lock = threading.Lock()

    def close(self) -> None:
        self._db.close()


def _json_obj(raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


__all__ = ["DB_NAME", "DamagedRecord", "StoreReader", "StoredSession", "TurnStore", "check_data_dir"]
