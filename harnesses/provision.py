"""Install harness CLIs on this machine, under ``/opt/ares-agents`` (used by ``.ci/provision-agents.sh``).

``python3 -m harnesses.provision [NAME ...]`` installs each named harness (default: all registered)
with its own install steps, in a non-isolated local sandbox running as the current user, so the
result is exactly what a harness finds and reuses later (local sandboxes see the host's
``/opt/ares-agents`` read-only; ``docker/agents/Dockerfile`` copies it into the agents image).
Prints one line per harness with the version and the seconds it took; exits 1 on a failure.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid

from sandbox import LocalSandbox, SandboxSpec

from . import registry
from .base import INSTALL_ROOT, HarnessContext, HarnessError


async def provision(names: list[str], install_root: str) -> int:
    failed = 0
    async with LocalSandbox(SandboxSpec(), isolate=False) as sb:
        for name in names:
            harness = registry.create(name, user=None, install_root=install_root)
            ctx = HarnessContext(workdir=sb.workdir, session_id="provision-" + uuid.uuid4().hex[:8],
                                 base_url="http://127.0.0.1:9", token="unused")
            started = time.monotonic()
            try:
                await harness.prepare(sb, ctx)
                info = await harness.install(sb)
            except HarnessError as exc:
                print(f"FAILED {exc}", file=sys.stderr)
                failed += 1
                continue
            how = "already installed" if info.reused else "installed"
            print(f"{name} {info.version} {how} in {time.monotonic() - started:.1f} s at {info.prefix}")
    return 1 if failed else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help=f"harnesses to install (default: {', '.join(registry.names())})")
    ap.add_argument("--install-root", default=INSTALL_ROOT)
    args = ap.parse_args()
    sys.exit(asyncio.run(provision(args.names or registry.names(), args.install_root)))


if __name__ == "__main__":
    main()
