"""The durable turn store: every answered turn and every session, in one SQLite file in a data dir.

Layout of a data directory (0700, this user's; every file 0600, opened with ``O_NOFOLLOW``: the
database and its WAL hold live session tokens)::

    DIR/gateway.sqlite3        sessions + turns (SQLite, WAL mode)
    DIR/gateway.sqlite3-wal    SQLite's write-ahead log (and -shm, its index)
    DIR/lock                   held with flock() by the one gateway using DIR (its pid inside)

Why SQLite: it is in the standard library, one file, crash-safe by design (a torn write at the
end of the WAL is ignored on open), and readable by any tool (``sqlite3 DIR/gateway.sqlite3``).

**Writes** happen on one writer thread: the event loop only encodes a turn and gathers it; what a
loop iteration gathered goes to the thread at once (at its end, or at a barrier), and the thread
commits whatever has queued up in one transaction (many turns of many sessions share a commit).
Unless someone waits for it (a barrier), a commit waits ``commit_delay`` (5 ms) for more writes to
join it: one agent's turns, a few hundred a second, then share commits too.
:meth:`TurnStore.barrier` is a future that is done once everything queued before it is committed;
``/respond`` awaits it (``Gateway.durable``), so its 200 means the turn is in the database.

**fsync policy**: ``journal_mode=WAL`` with ``synchronous=NORMAL``. A commit is a ``write()`` into
the WAL (the OS page cache), without fsync; the WAL is fsynced at checkpoints. A committed turn
therefore survives the gateway process dying in any way (``kill -9``, OOM kill, a crash); only a
power loss or kernel crash may lose the last commits (never corrupting older ones).
``synchronous="FULL"`` (a constructor argument) fsyncs every commit instead.

**Lost writes**: a batch whose commit fails (a full disk) loses its turn records, and so does a
record that continues a lost one; each gets a tombstone (:func:`lost_record`), written with the
next commit that succeeds, and the recorder encodes the session's next records whole
(:meth:`TurnStore.drain_lost`), so no record ever continues one the database lacks.

**Integrity**: each turn's payload carries a CRC-32. A record that fails it (a damaged disk block,
a file edited by hand) is skipped and reported by :meth:`TurnStore.load_turns`; the rest loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import queue
import shutil
import sqlite3
import stat
import struct
import threading
import time
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
);
"""
# A rowid table: records are appended in the order they come (a commit dirties the last page or two
# and a few pages of the small (session, seq) index), where the WITHOUT ROWID table of earlier
# versions kept each record inside its session's part of the key order, so a commit of many sessions'
# turns rewrote a page per session into the WAL: 2-4x the writer's CPU per turn (bench/bench_store.py).
# Data dirs made with that table keep it and are read and written as before: same columns, same key.


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


def prepare_data_dir(path: Path) -> None:
    """Create ``path`` as a directory only this user can enter (0700), or check an existing one.

    Raises :class:`DataDirError` for a path that is not a directory, cannot be created, or belongs
    to another user (who could swap the files in it); a directory others may read is made 0700,
    with a warning (it holds live session tokens).
    """
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except FileExistsError:
        raise DataDirError(
            f"cannot create data dir {path}: a file of that name is in the way; pass a directory "
            "as --data-dir") from None
    except OSError as exc:
        raise DataDirError(
            f"cannot create data dir {path}: {exc.strerror or exc}; pass a writable --data-dir") from None
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise DataDirError(f"data dir {path} is not a directory; pass a directory as --data-dir")
    if st.st_uid != os.geteuid():
        raise DataDirError(
            f"data dir {path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): "
            "whoever owns it can replace the files in it; pass a directory of your own as --data-dir"
        )
    if st.st_mode & 0o077:
        try:
            os.chmod(path, 0o700)
        except OSError as exc:
            raise DataDirError(
                f"data dir {path} is mode {stat.S_IMODE(st.st_mode):o} and cannot be made 0700 "
                f"({exc.strerror or exc}); fix its permissions") from None
        log.warning("data dir %s was mode %o (others could read its session tokens): made 0700",
                    path, stat.S_IMODE(st.st_mode))


def check_data_dir(path: Path, *, min_free_bytes: int) -> None:
    """Raise :class:`DataDirError` unless ``path`` is (or can be made) a private (0700) writable
    directory with room (see :func:`prepare_data_dir`)."""
    prepare_data_dir(path)
    probe = path / f".probe-{os.getpid()}"
    with contextlib.suppress(OSError):
        probe.unlink()  # a stale one (a crashed start): O_EXCL below must create a file of ours
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, b"x" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
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
            f"data dir {path} has {free // 2**20} MiB free, less than the {min_free_bytes // 2**20} "
            "MiB required (min_free_bytes): free space or pass another --data-dir"
        )


def _open_private(path: Path, flags: int, *, fix_mode: bool = True) -> int:
    """Open (``flags`` may create) a regular file of the data dir, never through a symlink, and make
    it 0600 unless ``fix_mode`` is false (it may hold session tokens): :class:`DataDirError` for a
    symlink or anything but a regular file."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise DataDirError(f"{path} is a symbolic link; a data dir holds its own files: remove it, "
                               "or pass another --data-dir") from None
        raise DataDirError(
            f"cannot open {path} ({exc.strerror or exc}); fix it or pass another --data-dir") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DataDirError(f"{path} is not a regular file; move it away or pass another --data-dir")
        if fix_mode and stat.S_IMODE(st.st_mode) != 0o600:
            os.fchmod(fd, 0o600)
            if st.st_size:
                log.warning("%s was mode %o: made 0600", path, stat.S_IMODE(st.st_mode))
    except BaseException:
        os.close(fd)
        raise
    return fd


#: SQLite's side files, beside the database (created with the database file's mode: 0600).
_SIDE_FILES = ("-wal", "-shm", "-journal")
_WAL_MAGIC = (0x377F0682, 0x377F0683)  # little- / big-endian checksums
_WAL_HEADER = 32
_WAL_FRAME_HEADER = 24


def _wal_checksum(data: bytes, big: bool, s1: int, s2: int) -> tuple[int, int]:
    # SQLite's walChecksumBytes: over pairs of 32-bit words, in the byte order the magic names.
    words = struct.unpack((">" if big else "<") + f"{len(data) // 4}I", data)
    m = 0xFFFFFFFF
    for i in range(0, len(words), 2):
        s1 = (s1 + words[i] + s2) & m
        s2 = (s2 + words[i + 1] + s1) & m
    return s1, s2


def inspect_wal(wal: Path) -> str | None:
    """What of the write-ahead log ``wal`` SQLite will discard on open, in words, or ``None`` when
    it keeps all of it (or there is none): a WAL whose header is not valid is ignored whole (with
    every commit in it); frames of the WAL's current generation after its last valid commit (a
    torn write, or damage) are dropped. Frames of an older generation past the end are SQLite's
    normal leftovers, not reported."""
    try:
        with open(wal, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    if not data:
        return None
    size = len(data)
    if size < _WAL_HEADER:
        return f"{size} bytes, too short for a WAL header"
    magic, version, page_size, _, salt1, salt2, c1, c2 = struct.unpack(">8I", data[:_WAL_HEADER])
    if magic not in _WAL_MAGIC or version != 3007000 or page_size < 512 or page_size & (page_size - 1):
        return f"{size} bytes that are not a SQLite WAL (bad header)"
    big = bool(magic & 1)
    s1, s2 = _wal_checksum(data[:24], big, 0, 0)
    if (s1, s2) != (c1, c2):
        return f"{size} bytes whose WAL header fails its checksum"
    frame = _WAL_FRAME_HEADER + page_size
    off, committed_end, frames, good = _WAL_HEADER, _WAL_HEADER, 0, 0
    while off + frame <= size:
        pgno, commit, fs1, fs2, fc1, fc2 = struct.unpack(">6I", data[off : off + _WAL_FRAME_HEADER])
        if (fs1, fs2) != (salt1, salt2):
            break  # an older generation's frame: the current one ended before it
        frames += 1
        t1, t2 = _wal_checksum(data[off : off + 8], big, s1, s2)
        t1, t2 = _wal_checksum(data[off + _WAL_FRAME_HEADER : off + frame], big, t1, t2)
        if pgno == 0 or (t1, t2) != (fc1, fc2):
            break
        s1, s2 = t1, t2
        good += 1
        off += frame
        if commit:
            committed_end = off
    else:
        if off < size and size - off >= _WAL_FRAME_HEADER:
            tail = struct.unpack(">6I", data[off : off + _WAL_FRAME_HEADER])
            if (tail[2], tail[3]) == (salt1, salt2):
                frames += 1  # a frame of this generation cut short
    dropped = frames - ((committed_end - _WAL_HEADER) // frame)
    if dropped > 0:
        return (f"{dropped} frame(s) after the last commit (of {frames}; {good} with a valid checksum), "
                "uncommitted or damaged")
    return None


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
        """Every session in the data dir, oldest first, with its number of recorded turns.

        Raises :class:`DataDirError` for a table that cannot be read or a session row no gateway
        wrote (an id or token that is not a non-empty string, a token two sessions share: the
        file was edited, and which session a token opens would be a guess)."""
        self.flush()
        where = getattr(self, "path", "the data dir")
        try:
            rows = self._read(
                "SELECT s.id, s.token, s.created_at, s.metadata, s.ended, s.ended_at, s.reward, s.truncated, "
                "s.end_info, (SELECT COUNT(*) FROM turns t WHERE t.session_id = s.id) FROM sessions s "
                "ORDER BY s.created_at"
            )
        except sqlite3.DatabaseError as exc:
            raise DataDirError(f"the sessions of {where} cannot be read ({exc}); move the data dir away "
                               "or pass another --data-dir") from None
        out = []
        tokens: dict[str, str] = {}
        for sid, token, created, meta, ended, ended_at, reward, truncated, info, turns in rows:
            if not isinstance(sid, str) or not sid or not isinstance(token, str) or not token:
                raise DataDirError(
                    f"{where}: a session row has no usable id or token (id {str(sid)[:40]!r}); "
                    "the database was edited: move it away or pass another --data-dir")
            if token in tokens:
                raise DataDirError(
                    f"{where}: sessions {tokens[token]!r} and {sid!r} have the same token; the "
                    "database was edited: delete one of them, or pass another --data-dir")
            tokens[token] = sid
            if not isinstance(created, (int, float)) or not isinstance(reward, (int, float, type(None))) \
                    or not isinstance(ended_at, (int, float, type(None))):
                raise DataDirError(
                    f"{where}: session {sid!r} has a created_at, ended_at or reward that is not a "
                    "number; the database was edited: move it away or pass another --data-dir")
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
                damaged.append(
                    DamagedRecord(sid, int(seq), "checksum mismatch (the record is damaged or truncated)"))
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
        commit_delay: seconds the writer waits after a write arrives, for more to share its commit
            (a commit costs the same for one turn or a hundred); a barrier (``/respond``'s 200,
            :meth:`barrier`, :meth:`flush`) does not wait for it. ``0`` commits at once.
        max_batch: most queued writes committed in one transaction (a loop iteration's writes go
            together, so one batch may pass it by those).
        cache_kib: SQLite's page cache for the connection, in KiB (memory the gateway holds).
        max_retry: most small writes (session rows, tombstones of lost turns) a failed batch keeps
            for the next commit; beyond it the oldest are dropped (logged).

    Raises :class:`DataDirError` when the directory is not writable, is too full, is locked by
    another gateway, belongs to another user, holds a symlink where its files go, or holds a file
    that is not a gateway database of this schema version (see :func:`_check_schema`).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        min_free_bytes: int = 64 * 2**20,
        synchronous: str = "NORMAL",
        max_batch: int = 512,
        commit_delay: float = 0.005,
        cache_kib: int = 512,
        max_retry: int = 100_000,
    ) -> None:
        if synchronous.upper() not in ("NORMAL", "FULL"):
            raise ValueError('synchronous must be "NORMAL" or "FULL"')
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if not 0 <= commit_delay <= 1:
            raise ValueError("commit_delay must be between 0 and 1 second")
        self.commit_delay = commit_delay
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
        #: Lists of writes for the writer thread (``None``: stop).
        self._queue: queue.SimpleQueue[list[tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._pending = 0  # writes queued and not yet committed (read on the loop thread)
        self._pending_lock = threading.Lock()
        # Writes made on an event loop gather here and go to the writer once per loop iteration
        # (or at a barrier): one wake-up and one transaction for all of them, where a hand-off per
        # write woke the thread for each, and each wake-up took the GIL from the loop.
        self._buf: list[tuple[Any, ...]] = []
        self._buf_loop: asyncio.AbstractEventLoop | None = None
        self._urgent = threading.Event()  # someone waits for a commit: do not wait for more writes
        self._idle = threading.Event()
        self._idle.set()
        #: The first write error since start (disk full, I/O error); later writes keep trying.
        self.error: BaseException | None = None
        self.commits = 0
        #: Turn records that never reached the database (their batch failed, or they continue one
        #: that did), per session: a later record that continues one of them is not written either
        #: (it could not be decoded), and each gets a tombstone (:func:`lost_record`) instead.
        self._lost: dict[str, set[int]] = {}
        self._lost_new: list[tuple[str, int]] = []
        self._lost_lock = threading.Lock()
        #: Bumped each time records are lost; the recorder then starts those sessions' lines afresh.
        self.lost_version = 0
        #: How many turn records were lost since start.
        self.lost_turns = 0
        #: Writes of a failed batch kept for the next one: tombstones and session changes (small).
        self._retry: list[tuple[Any, ...]] = []
        self.max_retry = max_retry
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="ares-turn-store", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ opening

    def _take_lock(self) -> int:
        lock_path = self.path / LOCK_NAME
        fd = _open_private(lock_path, os.O_RDWR | os.O_CREAT)
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
        # The database is created here, 0600 and never through a symlink, before SQLite opens it:
        # SQLite gives its -wal and -shm files the database file's mode, so they are 0600 from
        # their creation (they hold the same session tokens). The directory is ours and 0700, so
        # nobody can put a symlink in its place between this check and SQLite's open.
        # An existing file's mode is fixed only once it is known to be a gateway database.
        os.close(_open_private(db_path, os.O_RDWR | os.O_CREAT, fix_mode=False))
        sides = [self.path / (DB_NAME + suffix) for suffix in _SIDE_FILES]
        for side in sides:
            if os.path.lexists(side):
                os.close(_open_private(side, os.O_RDONLY, fix_mode=False))
        lost = inspect_wal(self.path / (DB_NAME + "-wal"))
        #: What SQLite discarded of the write-ahead log on open (``None``: nothing), in words.
        self.discarded_wal = lost
        if lost is not None:
            keep = self.path / f"{DB_NAME}-wal.discarded-{time.strftime('%Y%m%dT%H%M%S')}"
            try:
                src = _open_private(self.path / (DB_NAME + "-wal"), os.O_RDONLY)
                dst = _open_private(keep, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                with os.fdopen(src, "rb") as fi, os.fdopen(dst, "wb") as fo:
                    shutil.copyfileobj(fi, fo)
                where = f"a copy is in {keep.name}"
            except (OSError, DataDirError) as exc:
                where = f"no copy kept: {exc}"
            log.warning(
                "data dir %s: %s-wal holds %s; SQLite discards that part of it, with the sessions and "
                "turns it held (%s)", self.path, DB_NAME, lost, where)
        try:
            # The connection is opened here and then used only by the writer thread, or by the
            # loop thread while the writer is idle under _db_lock: never by both at once.
            db = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
            try:
                _check_schema(db, db_path)
                for f in (db_path, *sides):
                    if os.path.lexists(f):
                        os.close(_open_private(f, os.O_RDONLY))  # 0600, before SQLite writes a token
                db.execute("PRAGMA journal_mode=WAL")
                db.execute(f"PRAGMA synchronous={synchronous}")
                # SQLite's own page cache is gateway memory; appends touch a few pages, reads are rare,
                # and the OS caches the file anyway.
                db.execute(f"PRAGMA cache_size=-{int(self.cache_kib)}")
                db.executescript(_SCHEMA)
                if db.execute("SELECT value FROM meta WHERE key='schema'").fetchone() is None:
                    db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            except BaseException:
                db.close()
                raise
        except sqlite3.DatabaseError as exc:
            raise DataDirError(
                f"{db_path} cannot be used as a gateway database ({exc}); move it away or pass "
                "another --data-dir"
            ) from None
        self._db_lock = threading.Lock()
        return db

    # ------------------------------------------------------------------ writes (any thread -> writer)

    def _put(self, op: tuple[Any, ...]) -> None:
        if self._closed:
            raise DataDirError("the turn store is closed")
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        gathered = first = False
        stale: list[tuple[Any, ...]] = []
        with self._pending_lock:
            self._pending += 1
            if self._pending == 1:
                self._idle.clear()
            if self._buf and self._buf_loop is not None and self._buf_loop.is_closed():
                stale, self._buf = self._buf, []  # its loop ended before it handed them off
            if loop is not None and (not self._buf or loop is self._buf_loop):
                first, gathered = not self._buf, True
                self._buf_loop = loop
                self._buf.append(op)
        if stale:
            self._queue.put(stale)
        if first:
            assert loop is not None
            loop.call_soon(self._hand_off)
        elif not gathered:  # no loop here, or another loop's: straight to the writer
            self._queue.put([op])

    def _hand_off(self) -> None:
        """Give the writer what the loop has gathered (thread-safe; a no-op when nothing has)."""
        with self._pending_lock:
            buf, self._buf = self._buf, []
        if buf:
            self._queue.put(buf)

    def put_session(self, sid: str, token: str, created_at: float, metadata: dict[str, Any]) -> None:
        self._put(("session", sid, token, created_at, orjson.dumps(metadata, default=str)))

    def end_session(
        self, sid: str, *, reward: float | None, truncated: bool, end_info: dict[str, Any], ended_at: float
    ) -> None:
        self._put(("end", sid, reward, int(truncated), orjson.dumps(end_info, default=str), ended_at))

    def delete_session(self, sid: str) -> None:
        self._put(("delete", sid))

    def put_turn(self, sid: str, seq: int, payload: bytes, deps: Iterable[int] = ()) -> None:
        """Queue turn ``seq``'s record; ``deps``: the turns of the session it is a delta against
        (it is not written, but replaced by a tombstone, when one of them never reached the database)."""
        self._put(("turn", sid, seq, payload, zlib.crc32(payload), tuple(deps)))

    def drain_lost(self) -> list[tuple[str, int]]:
        """The (session, turn) records lost since the last call (for the recorder, which then
        encodes those sessions' next records whole)."""
        with self._lost_lock:
            out, self._lost_new = self._lost_new, []
        return out

    def _mark_lost(self, sid: str, seq: int, reason: str) -> None:
        with self._lost_lock:
            self._lost.setdefault(sid, set()).add(seq)
            self._lost_new.append((sid, seq))
            self.lost_version += 1
            self.lost_turns += 1
        log.error("turn store %s: session %s turn %d was not recorded: %s", self.path, sid, seq, reason)
        payload = lost_record(reason)
        self._retry.append(("tomb", sid, seq, payload, zlib.crc32(payload)))

    def barrier(self) -> asyncio.Future[None]:
        """A future done once every write queued before this call is committed (or failed)."""
        b = _Barrier(asyncio.get_running_loop())
        if self._pending == 0 and self.error is None and not self._retry:
            b.future.set_result(None)
            return b.future
        self._put(("barrier", b))
        self._hand_off()  # its waiter waits for the commit: no need to wait for the loop's next turn too
        self._urgent.set()
        return b.future

    def flush(self, timeout: float = 30.0) -> bool:
        """Block until every queued write is committed; False if that took longer than ``timeout``."""
        self._hand_off()  # on the loop's thread, the loop cannot hand off what it gathered while we wait
        self._urgent.set()
        return self._idle.wait(timeout)

    # ------------------------------------------------------------------ the writer thread

    def _write_loop(self) -> None:
        while True:
            ops = self._queue.get()
            if ops is None:
                if self._retry:
                    self._commit([])  # a last try for what a failed batch left
                return
            batch = list(ops)
            if self.commit_delay and not any(op[0] == "barrier" for op in batch):
                self._urgent.wait(self.commit_delay)
            self._urgent.clear()  # set again by a barrier queued after this: the next wait is short
            while len(batch) < self.max_batch:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)  # stop after this batch
                    break
                batch.extend(nxt)
            self._commit(batch)
            with self._pending_lock:
                self._pending -= len(batch)
                if self._pending == 0:
                    self._idle.set()

    def _commit(self, batch: list[tuple[Any, ...]]) -> None:
        # A record that continues a lost one could never be decoded: it is lost too (a tombstone).
        ops: list[tuple[Any, ...]] = []
        dropped = 0
        for op in batch:
            if op[0] == "turn" and op[5]:
                gone = self._lost.get(op[1])
                if gone and not gone.isdisjoint(op[5]):
                    self._mark_lost(op[1], op[2],
                                    f"it continues turn {min(gone & set(op[5]))}, which was lost")
                    dropped += 1
                    continue
            elif op[0] == "delete":
                self._lost.pop(op[1], None)
                self._retry = [r for r in self._retry if r[0] != "tomb" or r[1] != op[1]]
            ops.append(op)
        retry, self._retry = self._retry, []
        error: BaseException | None = None
        with self._db_lock:
            try:
                self._apply(retry + ops)
                self.commits += 1
            except (sqlite3.Error, OSError) as exc:
                error = exc
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
                if self.error is None:
                    log.error("turn store %s: a write failed: %s", self.path, exc)
                self.error = exc
        if error is not None:
            # The small writes are tried again with the next batch; a turn's record is lost (the
            # recorder encodes the next one whole), and its tombstone is tried again instead.
            self._retry = [r for r in retry if r[0] != "turn"]
            for op in ops:
                if op[0] == "turn":
                    self._mark_lost(op[1], op[2], f"writing it failed ({error})")
                elif op[0] in ("session", "end", "delete"):
                    self._retry.append(op)
            if len(self._retry) > self.max_retry:
                log.error("turn store %s: %d writes waiting for space; the oldest %d are dropped", self.path,
                          len(self._retry), len(self._retry) - self.max_retry)
                del self._retry[: len(self._retry) - self.max_retry]
        failed: DataDirError | None = None
        if error is not None:
            failed = DataDirError(f"recording to {self.path} failed: {error}")
        elif dropped:  # committed, but not every turn: a barrier must not say they all are
            failed = DataDirError(f"recording to {self.path} failed: {dropped} turn record(s) continued one "
                                  "that was lost")
        for item in batch:
            if item[0] == "barrier":
                b: _Barrier = item[1]
                err = failed
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                    b.loop.call_soon_threadsafe(_resolve, b.future, err)

    def _apply(self, batch: list[tuple[Any, ...]]) -> None:
        db = self._db
        db.execute("BEGIN")
        turns: list[tuple[Any, ...]] = []  # consecutive turns go in one executemany
        for op in batch:
            kind = op[0]
            if kind == "turn":
                turns.append(op[1:5])
                continue
            if turns:
                db.executemany("INSERT OR REPLACE INTO turns VALUES (?, ?, ?, ?)", turns)
                turns = []
            if kind == "tomb":
                db.execute("INSERT OR IGNORE INTO turns VALUES (?, ?, ?, ?)", op[1:5])
            elif kind == "session":
                db.execute(
                    "INSERT OR REPLACE INTO sessions (id, token, created_at, metadata) VALUES (?, ?, ?, ?)",
                    op[1:]
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
        if turns:
            db.executemany("INSERT OR REPLACE INTO turns VALUES (?, ?, ?, ?)", turns)
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
        self._hand_off()
        self._queue.put(None)
        self._urgent.set()
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


#: The first byte of a tombstone: the record of a turn that was answered but could not be recorded.
LOST_KIND = b"X"


def lost_record(reason: str) -> bytes:
    """A tombstone: what stands in the store for a turn whose record was lost (``reason`` says why);
    read back, it is reported as a damaged record with that reason, and never decoded as a turn."""
    return LOST_KIND + orjson.dumps({"lost": reason[:500]})


#: The columns of each table of a gateway database (a table with others is some other program's).
_COLUMNS = {
    "meta": ["key", "value"],
    "sessions": ["id", "token", "created_at", "metadata", "ended", "ended_at", "reward", "truncated",
                 "end_info"],
    "turns": ["session_id", "seq", "payload", "crc"],
}


def _check_schema(db: sqlite3.Connection, db_path: Path) -> None:
    """:class:`DataDirError` unless ``db`` is empty or a gateway database of :data:`SCHEMA_VERSION`
    (checked before anything is written to it: another program's database is never altered)."""
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if not tables:
        return
    foreign = (f"{db_path} is not a gateway database (it has tables {', '.join(sorted(tables))}); "
               "move it away or pass another --data-dir")
    if "meta" not in tables or not tables <= set(_COLUMNS):
        raise DataDirError(foreign)
    for table in tables:
        if [r[1] for r in db.execute(f"PRAGMA table_info({table})")] != _COLUMNS[table]:
            raise DataDirError(foreign)
    row = db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
    if row is None:
        if tables != set(_COLUMNS) or db.execute("SELECT 1 FROM sessions LIMIT 1").fetchone() is not None:
            raise DataDirError(f"{db_path} has no schema version; move it away or pass another --data-dir")
        return  # created, and stopped before its version was written
    if str(row[0]).strip() != str(SCHEMA_VERSION):
        raise DataDirError(
            f"{db_path} has schema version {str(row[0])[:40]!r}; this gateway reads version "
            f"{SCHEMA_VERSION}: "
            "use the gateway that wrote it, or pass another --data-dir"
        )


def _json_obj(raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


__all__ = ["DB_NAME", "LOST_KIND", "DamagedRecord", "StoreReader", "StoredSession", "TurnStore",
           "check_data_dir", "inspect_wal", "lost_record", "prepare_data_dir"]
