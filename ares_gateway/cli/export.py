"""``ares-gateway export DIR``: every training sample of a data dir (or a run's) as JSONL or Parquet,
or a run's episodes as ATIF trajectories (``--format atif``, ``ares_gateway.episodes.atif``).

The JSONL shape is the one ``trajectories/*.jsonl`` of a run has (``Sample.to_dict()`` per line:
``tokens``, ``response_length``, ``loss_mask``, ``logprobs``, ``reward``, ``metadata`` with
``session_id``, ``turn_ids`` and ``policy_versions``). Parquet (``pip install 'ares-gateway[export]'``,
pyarrow) has one row per sample: ``session_id``, ``sample_index``, ``tokens``, ``response_length``,
``loss_mask``, ``logprobs``, ``reward``, ``side_call``, ``turn_ids``, ``trained_turn_ids``,
``policy_versions`` (``start``, ``end``, ``version`` per trained response; ``version`` null where none
is known), ``mixed_versions`` and ``metadata`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ares_gateway.cli._support import HelpFormatter
from ares_gateway.core.errors import DataDirError
from ares_gateway.core.session_recorder import SessionRecorder
from ares_gateway.core.store import DB_NAME, StoreReader
from trajectory import Sample


def find_data_dir(path: Path) -> Path:
    """``path`` itself when it is a data dir, else the one data dir directly below it (a run's)."""
    if (path / DB_NAME).is_file():
        return path
    found = sorted(p.parent for p in path.glob(f"*/{DB_NAME}"))
    if len(found) == 1:
        return found[0]
    if not found:
        raise DataDirError(f"no gateway data dir in {path} (no {DB_NAME} in it or in a directory below it)")
    raise DataDirError(f"{path} holds several data dirs ({', '.join(map(str, found))}): name one")


def iter_samples(data_dir: Path, *, reward_default: float = 0.0) -> Iterator[tuple[str, int, Sample]]:
    """(session id, index, sample) for every session of ``data_dir``, oldest session first."""
    reader = StoreReader(data_dir)
    try:
        rec = SessionRecorder(store=reader)  # type: ignore[arg-type]
        sessions = reader.load_sessions()
        rec.known({s.id for s in sessions if s.turns})
        for s in sessions:
            reward = s.reward if s.reward is not None else reward_default
            for i, sample in enumerate(rec.samples(s.id, reward=reward)):
                yield s.id, i, sample
        for sid, damaged in rec.damaged.items():
            for d in damaged:
                print(f"warning: session {sid} turn {d.seq} skipped: {d.reason}", file=sys.stderr)
    finally:
        reader.close()


def _write_jsonl(rows: Iterator[tuple[str, int, Sample]], out: Path) -> int:
    n = 0
    with open(out, "w", encoding="utf-8") as fh:
        for _, _, sample in rows:
            fh.write(json.dumps(sample.to_dict()) + "\n")
            n += 1
    return n


def _write_parquet(rows: Iterator[tuple[str, int, Sample]], out: Path) -> int:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise SystemExit(
            "export --format parquet needs pyarrow: pip install 'ares-gateway[export]'") from None
    schema = pa.schema([
        ("session_id", pa.string()),
        ("sample_index", pa.int32()),
        ("tokens", pa.list_(pa.int32())),
        ("response_length", pa.int32()),
        ("loss_mask", pa.list_(pa.int32())),
        ("logprobs", pa.list_(pa.float32())),
        ("reward", pa.float64()),
        ("side_call", pa.bool_()),
        ("turn_ids", pa.list_(pa.int32())),
        ("trained_turn_ids", pa.list_(pa.int32())),
        ("policy_versions",
         pa.list_(pa.struct([("start", pa.int32()), ("end", pa.int32()), ("version", pa.int64())]))),
        ("mixed_versions", pa.bool_()),
        ("metadata", pa.string()),
    ])
    n = 0
    with pq.ParquetWriter(out, schema) as writer:
        batch: dict[str, list[Any]] = {f.name: [] for f in schema}
        for sid, i, s in rows:
            batch["session_id"].append(sid)
            batch["sample_index"].append(i)
            batch["tokens"].append(s.tokens)
            batch["response_length"].append(s.response_length)
            batch["loss_mask"].append(s.loss_mask)
            batch["logprobs"].append(s.logprobs)
            batch["reward"].append(float(s.reward))
            batch["side_call"].append(bool(s.metadata.get("side_call")))
            batch["turn_ids"].append(list(s.metadata.get("turn_ids", [])))
            batch["trained_turn_ids"].append(list(s.metadata.get("trained_turn_ids", [])))
            batch["policy_versions"].append([{"start": a, "end": b, "version": v}
                                             for a, b, v in s.metadata.get("policy_versions", [])])
            batch["mixed_versions"].append(bool(s.metadata.get("mixed_versions")))
            batch["metadata"].append(json.dumps(s.metadata, default=str))
            n += 1
            if len(batch["session_id"]) >= 256:
                writer.write_table(pa.table(batch, schema=schema))
                batch = {f.name: [] for f in schema}
        if batch["session_id"]:
            writer.write_table(pa.table(batch, schema=schema))
    return n


def _export_atif(args: argparse.Namespace) -> int:
    from ares_gateway.episodes.atif import export_atif

    out = Path(args.out or "atif")
    try:
        report = export_atif(Path(args.dir), out, token_ids=not args.no_token_ids)
    except (FileNotFoundError, NotADirectoryError) as exc:
        print(f"ares-gateway export: {exc}", file=sys.stderr)
        return 2
    for line in report.problems:
        print(f"warning: {line}", file=sys.stderr)
    print(f"wrote {len(report.written)} ATIF trajectory file(s) from {args.dir} to {out}"
          + (f"; {len(report.problems)} problem(s) above" if report.problems else ""))
    return 0 if report.ok else 1


def cmd_export(args: argparse.Namespace) -> int:
    if args.format == "atif":
        return _export_atif(args)
    try:
        data_dir = find_data_dir(Path(args.dir))
        out = Path(args.out or f"samples.{args.format}")
        rows = iter_samples(data_dir)
        n = _write_jsonl(rows, out) if args.format == "jsonl" else _write_parquet(rows, out)
    except DataDirError as exc:
        print(f"ares-gateway export: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {n} sample(s) from {data_dir} to {out}")
    return 0


def add_export_command(sub: Any) -> None:
    p = sub.add_parser("export",
                       help="write every training sample of a data dir (or a run) as JSONL or Parquet, "
                                      "or a run's episodes as ATIF trajectories",
                       description="Write every training sample of a gateway data dir, or of a run directory "
                                   "holding one, as JSONL (the trajectories/ shape) or Parquet; or, with "
                                   "--format atif, one ATIF trajectory JSON per episode of a run directory "
                                   "(Harbor's format; exit status 1 when an episode could not be exported, "
                                   "each named on stderr).",
                       formatter_class=HelpFormatter)
    p.add_argument("dir", help="a data dir (serve --data-dir) or a run's output directory (atif: a run's)")
    p.add_argument("--format", choices=["jsonl", "parquet", "atif"], default="jsonl",
                   help="output format (default: jsonl)")
    p.add_argument("--out", default=None, metavar="PATH",
                   help="output file (default: samples.FORMAT); atif: a directory (default: atif)")
    p.add_argument("--no-token-ids", action="store_true",
                   help="atif: leave each step's token ids and logprobs out, keep the counts (every step's "
                        "prompt ids repeat the whole history)")
    p.set_defaults(handler=cmd_export)
