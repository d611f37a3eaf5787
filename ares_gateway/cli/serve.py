"""``ares-gateway serve``: the gateway alone; a policy answers through ``/poll`` and ``/respond``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from ares_gateway.cli._support import (
    HelpFormatter,
    refuse_secret_flag,
    run_on_uvloop,
    tune_gc,
    write_admin_token,
)
from ares_gateway.cli.run import add_tito_arguments
from ares_gateway.core.errors import DataDirError
from ares_gateway.core.store import prepare_data_dir
from ares_gateway.gateway import Gateway, GatewayConfig
from ares_gateway.http.server import HttpLimits
from ares_gateway.telemetry import Telemetry, TelemetryUnavailableError
from ares_gateway.viewer import mount_viewer

log = logging.getLogger("ares_gateway")

def setting_flags() -> list[tuple[str, str, dataclasses.Field[Any]]]:
    """The settings that are ``serve`` flags, from the fields' own metadata: (flag, where, field) with
    ``where`` ``"config"`` (a :class:`GatewayConfig` field) or ``"http"`` (one of its :class:`HttpLimits`),
    in declaration order. A field's ``help`` is its flag's help, its default the flag's."""
    out = []
    for where, cls in (("config", GatewayConfig), ("http", HttpLimits)):
        for f in dataclasses.fields(cls):
            if "help" in f.metadata:
                out.append(("--" + f.metadata.get("flag", f.name).replace("_", "-"), where, f))
    return out


def flag_error(exc: ValueError) -> str:
    """A setting's error with the ``serve`` flag that sets it named (the message names the field)."""
    message = str(exc)
    for flag, _, f in setting_flags():
        if message.startswith(f.name + " "):
            return f"{flag}: {message}"
    if message.startswith("max_body_bytes "):
        return f"--max-body-mb: {message}"
    return message


async def _serve(cfg: GatewayConfig, token_file: str | None = None, policy: Any = None,
                 concurrency: int = 1, telemetry: Telemetry | None = None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        gw = Gateway(cfg, telemetry=False if telemetry is None else telemetry)
    except ValueError as exc:  # a setting out of its range
        print(f"ares-gateway: error: {flag_error(exc)}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    try:
        mount_viewer(gw)  # the trajectory viewer at /ui/, behind the admin token
        await gw.start()
    except DataDirError as exc:
        print(f"ares-gateway: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    async with gw:
        # The admin token is a secret: say where it is, never what it is.
        where = f"generated, in {token_file}" if token_file else "given"
        print(
            f"ares-gateway listening on {gw.url} (admin token required: {where}; "
            f"sessions {'auto-created' if cfg.auto_sessions else 'created with POST /sessions'})",
            flush=True,
        )
        print(f"trajectory viewer: {gw.url}/ui/ (log in with the admin token)", flush=True)
        if policy is None:
            await stop.wait()
        else:
            from ares_gateway.policies import PolicyServer

            # The policy answers every session in this process; /poll still sees what it has not taken.
            async with policy, PolicyServer(gw, policy, concurrency=concurrency):
                print(f"answering every session with the {policy.kind} policy ({policy.run_info()})",
                      flush=True)
                await stop.wait()
        log.info("shutting down: failing %d parked request(s)", gw.broker.pending_count)


def _state_home() -> str:
    """``$XDG_STATE_HOME/ares-gateway`` (``~/.local/state/ares-gateway``)."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "ares-gateway")


def _data_dir(args: argparse.Namespace) -> str | None:
    """``--data-dir``, else ``$XDG_STATE_HOME/ares-gateway/data-PORT`` (one per port, so servers on other
    ports never share one; with ``--port 0``, one per process); ``None`` with ``--in-memory``."""
    if args.in_memory:
        return None
    return str(args.data_dir
               or os.path.join(_state_home(), f"data-{args.port}" if args.port else f"data-pid{os.getpid()}"))


#: The environment variable `serve` reads the admin token from (when no flag gives one).
ADMIN_TOKEN_ENV = "ARES_GATEWAY_ADMIN_TOKEN"


def read_admin_token_file(path: str) -> str:
    """The admin token in ``path`` (its first line, stripped); ``ValueError`` saying what is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.readline().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the admin token file {path}: {exc}") from None
    if not token:
        raise ValueError(f"the admin token file {path} is empty")
    return token


def _admin_token(args: argparse.Namespace) -> str | None:
    """The admin token from --admin-token-file, else $ARES_GATEWAY_ADMIN_TOKEN (never the command line)."""
    if args.admin_token_file:
        return read_admin_token_file(args.admin_token_file)
    return os.environ.get(ADMIN_TOKEN_ENV) or None


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        admin = _admin_token(args)
    except ValueError as exc:
        print(f"ares-gateway: error: {exc}", file=sys.stderr, flush=True)
        return 2
    token_file: str | None = None
    data_dir = _data_dir(args)
    try:
        if data_dir is not None:
            # Created 0700 (or checked) before anything is written in it: the admin token below
            # would otherwise create it with the umask's mode, and fail on a file with a traceback.
            prepare_data_dir(Path(data_dir).expanduser().resolve())
        if not admin:
            # Never an open control API: whoever reaches the port (an agent on the host's
            # network included) could read every request and answer or end any session. The token
            # lives beside the data it guards (the state home when nothing is written).
            admin, path = write_admin_token(data_dir or _state_home())
            token_file = str(path)
    except DataDirError as exc:
        print(f"ares-gateway: {exc}", file=sys.stderr, flush=True)
        return 2
    except OSError as exc:
        print(f"ares-gateway: cannot write the admin token in {data_dir or _state_home()} "
              f"({exc.strerror or exc}); pass a writable --data-dir or --admin-token-file", file=sys.stderr,
              flush=True)
        return 2
    flags = setting_flags()
    try:
        http = HttpLimits(max_body_bytes=args.max_body_mb * 1024 * 1024,
                          **{f.name: getattr(args, f.name) for _, where, f in flags if where == "http"})
    except ValueError as exc:
        print(f"ares-gateway: error: {flag_error(exc)}", file=sys.stderr, flush=True)
        return 2
    cfg = GatewayConfig(
        host=args.host,
        port=args.port,
        admin_token=admin,
        auto_sessions=args.auto_sessions,
        models=args.model or ["ares-gateway"],
        public_url=args.public_url,
        access_log=args.access_log,
        data_dir=False if data_dir is None else data_dir,
        retention_seconds=None if args.retention_days is None else args.retention_days * 86400.0,
        http=http,
        **{f.name: getattr(args, f.name) for _, where, f in flags if where == "config"},
    )
    policy = None
    if args.policy == "tito":
        from ares_gateway.cli.run import _build_tito

        try:  # run's tito flags, with the engine's model under its own name (--model lists /v1/models)
            policy = _build_tito(argparse.Namespace(**{**vars(args), "model": args.engine_model}))
        except ValueError as exc:
            print(f"ares-gateway: error: {exc}", file=sys.stderr, flush=True)
            return 2
    try:
        telemetry = Telemetry.from_env(enabled=True if args.otel else None,
                                       record_content=True if args.otel_content else None)
    except TelemetryUnavailableError as exc:
        print(f"ares-gateway: error: {exc}", file=sys.stderr, flush=True)
        return 2
    tune_gc()
    with contextlib.suppress(KeyboardInterrupt):
        run_on_uvloop(_serve(cfg, token_file, policy, args.policy_concurrency, telemetry))
    return 0


def add_serve_command(sub: Any) -> None:
    p = sub.add_parser("serve", help="run the gateway (agents talk to it; a policy answers through /poll)",
                       description="Run the gateway: agents talk to it; a policy answers through /poll "
                                   "and /respond.",
                       formatter_class=HelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port to bind; 0 picks a free one (default: 8080)")
    p.add_argument(
        "--admin-token-file",
        default=None,
        metavar="PATH",
        help="file holding the token guarding /poll, /respond, /sessions, /metrics (its first "
             "line); else env "
             f"{ADMIN_TOKEN_ENV}; without either a random token is generated and written to a 0600 file "
             "whose path is printed",
    )
    refuse_secret_flag(p, "--admin-token",
                       f"put the token in a file and pass --admin-token-file PATH, or set "
                                           f"${ADMIN_TOKEN_ENV}")
    for flag, where, f in setting_flags():
        default = getattr(GatewayConfig() if where == "config" else HttpLimits(), f.name)
        kind = int if default is None else type(default)  # None: derived at start (the connection cap)
        p.add_argument(flag, dest=f.name, metavar=flag[2:].replace("-", "_").upper(), type=kind,
                       default=default, help=f.metadata["help"])
    p.add_argument("--max-body-mb", type=int, default=HttpLimits().max_body_bytes // (1024 * 1024),
                   help="largest request body accepted, in MiB")
    p.add_argument(
        "--auto-sessions",
        action="store_true",
        help="create a session on first use of an unknown session id or token (local experiments only)",
    )
    p.add_argument("--model", action="append",
                   help="model id listed by /v1/models (repeatable) (default: ares-gateway)")
    p.add_argument("--public-url", default=None,
                   help="URL agents reach the gateway at, if not http://host:port")
    p.add_argument("--access-log", action="store_true",
                   help="log every HTTP request (paths only, never headers)")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="where every answered turn and session is recorded, durably (default: "
                        "$XDG_STATE_HOME/ares-gateway/data-PORT); "
                        "a restart with the same DIR knows its sessions again (docs/recording.md)")
    p.add_argument("--in-memory", action="store_true",
                   help="record in memory only (lost when the server stops)")
    p.add_argument("--retention-days", type=float, default=None,
                   help="at start, prune sessions that ended more than this many days ago from the data dir")
    p.add_argument("--policy", choices=("poll", "tito"), default="poll",
                   help="who answers: poll leaves every request to a policy on /poll and /respond; "
                        "tito answers in this process, rendering token ids itself and sampling them on "
                        "--engine (docs/tito.md)")
    add_tito_arguments(p)
    p.add_argument("--engine-model", default=None, metavar="PATH_OR_NAME",
                   help="tito: the GGUF path (llama-cpp; default: the embedded SmolLM2-135M-Instruct) or the "
                        "served model name (serve's --model names the ids listed by /v1/models)")
    p.add_argument("--policy-concurrency", type=int, default=1,
                   help="tito: requests in the policy at once (an in-process engine samples one at a time)")
    p.add_argument("--otel", action="store_true",
                   help="send OpenTelemetry spans per LLM call (the otel extra), configured by the OTEL_* "
                        "environment (its endpoint by default http://localhost:4318; docs/recording.md) "
                        "(default: off, unless OTEL_* asks for traces)")
    p.add_argument("--otel-content", action="store_true",
                   help="put request and answer contents on the spans (input.value, output.value): "
                        "they can hold secrets (default: off; env ARES_OTEL_RECORD_CONTENT=1)")
    p.add_argument("--log-level", default="INFO", help="log level (DEBUG, INFO, WARNING, ERROR)")
    p.set_defaults(handler=cmd_serve)
