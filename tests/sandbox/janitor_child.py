"""Child process for the janitor tests: creates sandboxes, prints them as JSON, then ends as told.

usage: python janitor_child.py MODE BACKEND[,BACKEND...]   MODE: exit | exception | wait
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import sandbox

DOCKERFILE = Path(__file__).parent / "images" / "Dockerfile"


async def main(mode: str, backends: list[str]) -> None:
    made = []
    for backend in backends:
        spec = sandbox.SandboxSpec(dockerfile=DOCKERFILE) if backend == "docker" else sandbox.SandboxSpec()
        sb = sandbox.create(spec, backend=backend)
        await sb.start()
        # A detached process inside, which cleanup must take down too.
        await sb.exec("nohup sleep 300 >/dev/null 2>&1 &")
        made.append(
            {"backend": sb.backend, "id": sb.id, "root": str(getattr(sb, "root", "")),
             "container": getattr(sb, "container_id", None)}
        )
    print(json.dumps(made), flush=True)
    if mode == "exception":
        raise RuntimeError("boom: uncaught exception with live sandboxes")
    if mode == "wait":
        await asyncio.sleep(600)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2].split(",")))
