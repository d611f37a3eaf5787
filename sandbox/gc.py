"""Garbage collection: remove the sandboxes of every backend whose owner process is gone.

It asks each backend for its sandboxes (its entry in :mod:`sandbox.registry`: ``gc_candidates``,
``gc_remove``) and :mod:`sandbox.janitor` whose owner is alive, so it sits above both: the backends
register with the janitor, and the janitor knows no backend.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from . import registry
from .janitor import DEFAULT_STALE_AFTER, OWNER_LABEL, SESSION_LABEL, owner_status, state_dir


@dataclass
class GcReport:
    removed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def collect_garbage(
    backends: Iterable[str] = ("docker", "local"),
    *,
    dry_run: bool = False,
    stale_after: float = DEFAULT_STALE_AFTER,
) -> GcReport:
    """Remove sandboxes (on the named backends) whose owner process is gone; keep live owners' ones.

    ``docker`` is skipped silently when no engine answers; ``daytona``, ``kubernetes`` and ``modal`` are
    looked at only when named (they need ``DAYTONA_API_KEY``, a kubeconfig, a Modal token).
    """
    report = GcReport()
    for backend in backends:
        mod = registry.get(backend)  # ValueError naming the backends there are
        try:
            candidates = mod.gc_candidates()
        except Exception as exc:
            report.errors.append(f"{backend}: cannot list sandboxes: {exc}")
            continue
        for ref, labels in candidates:
            name = f"{backend}:{ref}"
            status = owner_status(labels, stale_after=stale_after)
            if status == "alive":
                report.kept.append(name)
            elif status == "unknown":
                report.unknown.append(name)
            else:
                if not dry_run:
                    try:
                        mod.gc_remove(ref)
                    except Exception as exc:
                        report.errors.append(f"{name}: {exc}")
                        continue
                report.removed.append(name)
    # Heartbeat files of dead local sessions are garbage too.
    if not dry_run:
        hb_dir = state_dir() / "heartbeats"
        for path in hb_dir.glob("*.json") if hb_dir.is_dir() else []:
            try:
                info = json.loads(path.read_text())
                if owner_status({OWNER_LABEL: info.get("owner", ""), SESSION_LABEL: path.stem}) == "dead":
                    path.unlink(missing_ok=True)
            except (OSError, ValueError):
                continue
    return report
