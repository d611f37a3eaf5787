"""The durable turn store's cost per turn: the writer thread's CPU and the event loop's, over a real
data dir, as a gateway under load writes it (many sessions' turns, a commit per ``/respond`` batch).

    python3 bench/bench_store.py                          # 64 sessions, 350 B and 2 KB records, both layouts
    python3 bench/bench_store.py --record-bytes 2000 --sessions 512 --batch 100 --repeat 5

``--layout rowid`` is the turns table this version creates; ``without-rowid`` is the table of earlier
versions (a data dir made by them keeps it), made here by hand before the store opens the dir. A
record's size: a Claude Code turn's record (a body delta, the new prompt ids, 64 output ids and
their logprobs) is 1-3 KB; one without token ids a few hundred bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

from ares_gateway.core.store import DB_NAME, SCHEMA_VERSION, TurnStore

_LEGACY_TURNS = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE turns (
    session_id TEXT NOT NULL, seq INTEGER NOT NULL, payload BLOB NOT NULL, crc INTEGER NOT NULL,
    PRIMARY KEY (session_id, seq)
) WITHOUT ROWID;
"""


def _thread_cpu(tid: int) -> float:
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _run(layout: str, sessions: int, record_bytes: int, turns: int, batch: int) -> tuple[float, float]:
    """(writer thread CPU, event loop CPU) per turn, in microseconds."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data"
        if layout == "without-rowid":
            path.mkdir(mode=0o700)
            db = sqlite3.connect(path / DB_NAME)
            db.executescript(_LEGACY_TURNS)
            db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            db.commit()
            db.close()
            os.chmod(path / DB_NAME, 0o600)
        store = TurnStore(path)
        try:
            payload = os.urandom(record_bytes)  # records are compressed already: random bytes are fair
            ids = [f"{os.urandom(8).hex()}" for _ in range(sessions)]
            seqs = dict.fromkeys(ids, 0)
            await store.barrier()
            w0, m0 = _thread_cpu(store._writer.native_id or 0), time.thread_time()
            for i in range(turns):
                sid = ids[i % sessions]
                seqs[sid] += 1
                store.put_turn(sid, seqs[sid], payload, [seqs[sid] - 1] if seqs[sid] > 1 else [])
                if i % batch == batch - 1:
                    await store.barrier()  # what /respond does before its 200
            await store.barrier()
            w1, m1 = _thread_cpu(store._writer.native_id or 0), time.thread_time()
        finally:
            store.close()
    return (w1 - w0) / turns * 1e6, (m1 - m0) / turns * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--record-bytes", type=int, action="append")
    ap.add_argument("--batch", type=int, default=30, help="turns per commit (a /respond batch)")
    ap.add_argument("--turns", type=int, default=20000)
    ap.add_argument("--layout", action="append", choices=["rowid", "without-rowid"])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    for size in args.record_bytes or [350, 2000]:
        for layout in args.layout or ["rowid", "without-rowid"]:
            runs = [
                asyncio.run(_run(layout, args.sessions, size, args.turns, args.batch))
                for _ in range(args.repeat)
            ]
            writer = statistics.median(r[0] for r in runs)
            loop = statistics.median(r[1] for r in runs)
            print(
                f"{layout:>13}  {size:>5} B records  {args.sessions} sessions  {args.batch} a commit:  "
                f"writer {writer:5.1f} µs/turn  event loop {loop:4.1f} µs/turn",
                flush=True,
            )


if __name__ == "__main__":
    main()
