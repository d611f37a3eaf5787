"""The oracle's command for a Harbor-format task: its ``solution/`` played through the agent's shell.

The oracle policy (:mod:`ares_gateway.policies.scripted`) sends it as one shell command through the
agent's own tool, as Harbor's oracle does; :meth:`ares_gateway.episodes.tasks.Task.oracle_command`
is how it asks.
"""

from __future__ import annotations

import base64
import secrets
import shlex
from collections.abc import Mapping
from pathlib import Path

from ares_gateway.policies.base import PolicyError

#: Solutions larger than this are refused: they are sent as one shell command through the agent.
MAX_SOLUTION_BYTES = 256 * 1024


def oracle_command(name: str, solution_dir: Path | None, solution_env: Mapping[str, str]) -> str:
    """One shell command that recreates task ``name``'s ``solution/`` in a temporary directory and runs
    ``solve.sh`` from the current directory (the agent's workdir), with ``[solution] env``.

    Text files travel as quoted here-documents (readable in the trajectory), others base64-encoded.
    """
    if solution_dir is None:
        raise PolicyError(f"task {name!r} has no solution/solve.sh: the oracle has nothing to play",
                          status=500)
    files = sorted(p for p in Path(solution_dir).rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in files)
    if total > MAX_SOLUTION_BYTES:
        raise PolicyError(
            f"task {name!r}: solution/ holds {total} bytes; the oracle sends at most {MAX_SOLUTION_BYTES}",
            status=500,
        )
    # No `exit` anywhere: some agents (Terminus-2) type commands into a long-lived shell.
    lines = ['d=$(mktemp -d /tmp/ares-oracle.XXXXXX) || { d=/tmp/ares-oracle-$$; mkdir -p "$d"; }']
    for path in files:
        rel = path.relative_to(solution_dir).as_posix()
        target = f'"$d"/{shlex.quote(rel)}'
        if "/" in rel:
            lines.append(f'mkdir -p "$(dirname {target})"')
        data = path.read_bytes()
        text = _as_text(data)
        if text is not None:
            eof = f"ARES_ORACLE_EOF_{secrets.token_hex(4)}"
            body = text if text.endswith("\n") else text + "\n"
            lines.append(f"cat > {target} <<'{eof}'\n{body}{eof}")
        else:
            lines.append(f"printf '%s' {base64.b64encode(data).decode()} | base64 -d > {target}")
    exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in sorted(solution_env.items()))
    run = 'if command -v bash >/dev/null 2>&1; then bash "$d/solve.sh"; else sh "$d/solve.sh"; fi'
    lines.append(f"( {exports}{run} ); status=$?")
    # `rm -r`, not `rm -rf`: Codex refuses any command holding an `rm -f` (whatever its settings).
    lines.append(
        'rm -r "$d" </dev/null 2>/dev/null; echo "[oracle] solution/solve.sh exited with status $status"')
    return "\n".join(lines)


def _as_text(data: bytes) -> str | None:
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None
