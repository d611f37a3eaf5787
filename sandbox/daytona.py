"""``DaytonaSandbox``: a remote sandbox on Daytona, driven through the ``daytona`` package's async client.

Install with ``pip install 'ares-gateway[daytona]'`` and set ``DAYTONA_API_KEY`` (and ``DAYTONA_API_URL``
for a self-hosted Daytona).  The sandbox is created from the spec's image, Dockerfile, or Daytona's
default snapshot, with the spec's resources, labels (owner, session, creation time) and auto-stop /
auto-delete intervals as the last line of defence against leaks.

Commands go through the toolbox ``process/execute`` call wrapped in a small POSIX shell script that
runs them in their own session (``setsid``), keeps stderr apart from stdout, switches user with
``runuser``/``sudo`` and records the process-group id; on timeout a second call kills the whole
group inside the sandbox.  Directories travel as one tar archive through the batch file endpoints.

A sandbox whose spec has ``network="none"`` is created with ``network_block_all=True`` and reaches its
``forwards`` over the exec tunnel (:mod:`sandbox.tunnel`): ``_relay.py`` is uploaded (root-owned, its
hash checked) and runs as root in tunnel mode on a long-lived channel, ``tunnel="ssh"`` (default: an
SSH exec channel through Daytona's SSH gateway with an access token made for it, revoked when the
sandbox stops) or ``tunnel="pty"`` (a toolbox PTY session over the SDK's WebSocket).  See
:mod:`sandbox._daytona_channels` for what each transport guarantees.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import posixpath
import secrets
import shlex
import tempfile
import time
from pathlib import Path
from typing import Any

from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential

from . import janitor
from ._daytona_channels import MAX_WS_MESSAGE, daytona_pty_channel, parse_ssh_command, ssh_exec_channel
from ._procid import EXEC_DIR_SH, KILL_TOKEN, RECORD_AND_EXEC, RELAY_RECORD, USER_NAME_SH
from .errors import BackendUnavailableError, ExecError, FileTransferError, ForwardError, SandboxStartError
from .protocol import BaseSandbox, ExecResult, extract_tar, tar_directory
from .registry import import_sdk
from .spec import SandboxSpec
from .tunnel import Channel, Tunnel

_CWD_MISSING = 201
_GIB = 1024**3

# $1 token, $2 boundary, $3 cwd, $4 user ('' = default), $5 command, $6 RECORD_AND_EXEC.  The record of
# the command's session leader (pid and start time) and its stderr go to a directory only the
# wrapper's own user (root, or the default user that sudoes) can write, the record written before the
# command switches user: the agent can neither point a later kill at another process nor block the
# wrapper on a FIFO of its own.
_WRAPPER = EXEC_DIR_SH + r"""
p="$_ed/$1.pid"; e="$_ed/$1.err"; b=$2; d=$3; u=$4; c=$5; rec=$6
""" + USER_NAME_SH + r"""
if ! cd -- "$d" 2>/dev/null; then printf '%s' "$b"; echo "ares-exec: no such directory: $d"; exit 201; fi
if [ -z "$u" ]; then set -- /bin/sh -c "$c"
elif [ "$_uid" = 0 ]; then set -- runuser -u "$u" -- /bin/sh -c "$c"
else set -- sudo -n -u "$sudo_u" -- /bin/sh -c "$c"; fi
if command -v setsid >/dev/null 2>&1; then
  setsid -w /bin/sh -c "$rec" "$p" "$@" 2>"$e" </dev/null; rc=$?
else
  /bin/sh -c "$rec" "$p" "$@" 2>"$e" </dev/null; rc=$?
fi
printf '%s' "$b"; cat "$e" 2>/dev/null; rm -f "$e" "$p"; exit $rc
"""
_KILL = KILL_TOKEN


_RELAY_SCRIPT = Path(__file__).with_name("_relay.py")
# Run by root on the tunnel's channel: $1 the relay's directory, $2 port, $3 max streams.  Not root
# (Daytona's default user has passwordless sudo): again under sudo.  A relay of this port left from a
# dropped channel is killed first, only while its record ($d/relay-$port.id: pid and start time,
# written here as root) still names that very process, freeing the port.
_TUNNEL_SH = (
    'd=$1; port=$2; n=$3\nif [ "$(id -u)" != 0 ]; then exec sudo -n /bin/sh "$0" "$@"; fi\n'
    + RELAY_RECORD
    + '\nexec python3 -I "$d/relay.py" --listen "127.0.0.1:$port" --tunnel binary --ready-file '
      '"$d/relay-$port.pid" '
    '--max-connections "$n"\n'
)
# Run as root: $1, $2 the uploaded relay and tunnel script, $3 their directory.  Root-owned copies
# (the agent must not change what root runs next), then their hashes and python3's presence.
_INSTALL = r"""
a=$1; b=$2; d=$3
mkdir -p "$d" && chown 0:0 "$d" && chmod 755 "$d" && install -o 0 -g 0 -m 644 "$a" "$d/relay.py" \
  && install -o 0 -g 0 -m 644 "$b" "$d/tunnel.sh"; rc=$?; rm -f "$a" "$b"; [ $rc = 0 ] || exit $rc
command -v python3 >/dev/null 2>&1 || { echo "no python3"; exit 3; }
python3 -c 'import hashlib,sys; print(*(hashlib.sha256(open(f,"rb").read()).hexdigest() for f in sys.argv[1:]))' \
  "$d/relay.py" "$d/tunnel.sh"
"""  # noqa: E501 (an embedded script, kept as it runs)
_TUNNELS = ("ssh", "pty")


def _sdk() -> Any:
    return import_sdk("daytona", backend="Daytona", extra="daytona")


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, (ConnectionError, asyncio.TimeoutError, TimeoutError)):
        return True
    status = getattr(exc, "status_code", None) or getattr(exc, "status", None)
    return isinstance(status, int) and (status >= 500 or status == 429)


_retry = retry(
    retry=retry_if_exception(_transient),
    stop=stop_after_attempt(4),
    wait=wait_exponential(multiplier=0.3, max=4),
    reraise=True,
)


def _config(api_key: str | None, api_url: str | None, target: str | None) -> Any:
    sdk = _sdk()
    key = api_key or os.environ.get("DAYTONA_API_KEY")
    if not key:
        raise BackendUnavailableError(
            "the Daytona backend needs an API key: set DAYTONA_API_KEY (and DAYTONA_API_URL for a "
            "self-hosted Daytona) or pass api_key="
        )
    url = api_url or os.environ.get("DAYTONA_API_URL") or None
    return sdk.DaytonaConfig(api_key=key, api_url=url,
                             target=target or os.environ.get("DAYTONA_TARGET") or None)


class DaytonaSandbox(BaseSandbox):
    backend = "daytona"
    remote = True

    def __init__(
        self,
        spec: SandboxSpec | None = None,
        *,
        api_key: str | None = None,
        api_url: str | None = None,
        target: str | None = None,
        create_timeout: float = 180.0,
        tunnel: str | None = None,
        tunnel_max_streams: int = 256,
        relay_dir: str = "/.ares",
        ssh_expires_minutes: int = 60,
        ssh_known_hosts: Any = None,
        pty_max_message: int = MAX_WS_MESSAGE,
    ) -> None:
        """``tunnel`` picks the channel that carries ``forwards`` (network="none"): "ssh" (an SSH exec
        channel through Daytona's SSH gateway, flow-controlled end to end: the default) or "pty" (a
        toolbox PTY session over the SDK's WebSocket: no SSH egress needed, but the daemon drops a
        client that falls 256 messages behind).  ``relay_dir``: where the root-owned relay goes inside.
        ``ssh_expires_minutes``: the lifetime of each SSH access token (a new one is made when a channel
        is reopened near its end); ``ssh_known_hosts``: asyncssh's known_hosts for the gateway's key
        (None: not checked).  ``pty_max_message``: the largest WebSocket message sent (the daemon's
        read limit is 64 KiB). ``tunnel=None``: ``$ARES_DAYTONA_TUNNEL`` (``ares-gateway run --tunnel``), else
        "ssh"."""
        super().__init__(spec)
        tunnel = tunnel or os.environ.get("ARES_DAYTONA_TUNNEL") or "ssh"
        if tunnel not in _TUNNELS:
            raise ValueError("tunnel must be 'ssh' (an SSH exec channel) or 'pty' (a toolbox PTY session), "
                             f"got {tunnel!r}")
        if tunnel_max_streams < 1 or ssh_expires_minutes < 2 or not 0 < pty_max_message <= MAX_WS_MESSAGE:
            raise ValueError(
                f"need tunnel_max_streams >= 1, ssh_expires_minutes >= 2 and 0 < pty_max_message <= "
                f"{MAX_WS_MESSAGE}")
        if not posixpath.isabs(relay_dir):
            raise ValueError(f"relay_dir must be an absolute path inside the sandbox, got {relay_dir!r}")
        self._config = _config(api_key, api_url, target)
        self.create_timeout = create_timeout
        #: The channel that carries forwards: "ssh" or "pty".
        self.tunnel = tunnel
        self.tunnel_max_streams, self.relay_dir = tunnel_max_streams, relay_dir.rstrip("/") or "/"
        self.ssh_expires_minutes, self.ssh_known_hosts = ssh_expires_minutes, ssh_known_hosts
        self.pty_max_message = pty_max_message
        self._client: Any = None
        self._sandbox: Any = None
        self.remote_id: str | None = None
        self._name = f"ares-sbx-{self.id}"
        self._tunnels: dict[int, Tunnel] = {}
        self._relay_installed = False
        # The SSH access in use (token, host, port, expiry) and every token made, to revoke at stop.
        self._ssh: tuple[str, str, int, float] | None = None
        self._ssh_tokens: list[str] = []
        #: How many SSH accesses were revoked (tests, logs).
        self.ssh_revoked = 0

    @property
    def description(self) -> str:
        where = self._config.api_url or "Daytona cloud"
        tunnel = f"; forwards over a {self.tunnel} tunnel" if self.spec.network == "none" else ""
        return (f"daytona sandbox {self.id} (remote id {self.remote_id}, {where}, "
                f"network={self.spec.network}{tunnel})")

    # -- lifecycle ---------------------------------------------------------------------------------
    def _params(self) -> Any:
        sdk = _sdk()
        spec = self.spec
        common: dict[str, Any] = {
            "name": self._name,
            "env_vars": dict(spec.env),
            "labels": {**self.labels(), janitor.SANDBOX_LABEL: self.id},
            "auto_stop_interval": spec.auto_stop_minutes,
            "auto_delete_interval": spec.auto_delete_minutes,
            "network_block_all": True if spec.network == "none" else None,
        }
        res = spec.resources
        if spec.image or spec.dockerfile:
            image: Any = spec.image if spec.image else sdk.Image.from_dockerfile(str(spec.dockerfile_path()))
            resources = None
            if any(v is not None for v in (res.cpus, res.memory, res.disk, res.gpus)):
                resources = sdk.Resources(
                    cpu=max(1, round(res.cpus)) if res.cpus else None,
                    memory=max(1, -(-res.memory_bytes // _GIB)) if res.memory_bytes else None,
                    disk=max(1, -(-res.disk_bytes // _GIB)) if res.disk_bytes else None,
                    gpu=res.gpus,
                )
            return sdk.CreateSandboxFromImageParams(image=image, resources=resources, **common)
        return sdk.CreateSandboxFromSnapshotParams(**common)

    async def _start(self) -> None:
        sdk = _sdk()
        self._client = sdk.AsyncDaytona(self._config)
        params = self._params()

        @_retry
        async def create() -> Any:
            try:
                return await self._client.create(params, timeout=self.create_timeout)
            except sdk.DaytonaError as exc:
                if getattr(exc, "status_code", None) == 409:  # an earlier attempt did create it: adopt it
                    return await self._client.get(self._name)
                raise

        try:
            self._sandbox = await create()
        except sdk.DaytonaError as exc:
            raise SandboxStartError(f"Daytona could not create sandbox {self._name}: {exc}") from exc
        self.remote_id = str(self._sandbox.id)
        prep = await self._raw_exec(
            f"mkdir -p {shlex.quote(self.spec.workdir)} 2>/dev/null || "
            f"{{ sudo -n mkdir -p {shlex.quote(self.spec.workdir)} && sudo -n chown \"$(id -u)\" "
            f"{shlex.quote(self.spec.workdir)}; }}", timeout=60,
        )
        if prep[0] != 0:
            raise SandboxStartError(
                f"cannot create workdir {self.spec.workdir} in the Daytona sandbox: {prep[1]}")

    async def _stop(self) -> None:
        tunnels, self._tunnels = list(self._tunnels.values()), {}
        for tunnel in tunnels:
            with contextlib.suppress(Exception):
                await tunnel.close()
        await self._revoke_ssh()
        try:
            if self._sandbox is not None:
                await _retry(self._sandbox.delete)()
        except Exception as exc:
            if getattr(exc, "status_code", None) != 404:
                await asyncio.to_thread(self._remove_sync)
        finally:
            if self._client is not None:
                with contextlib.suppress(Exception):
                    await self._client.close()

    def _remove_sync(self) -> None:
        """Delete through the plain synchronous REST client (safe from signal handlers and atexit)."""
        if self.remote_id is None and self._sandbox is None:
            return
        tokens, self._ssh_tokens, self._ssh = self._ssh_tokens, [], None
        if tokens:
            self.ssh_revoked += _revoke_sync(self._config, self.remote_id or self._name, tokens)
        _delete_sync(self._config, self.remote_id or self._name)

    # -- the exec tunnel -----------------------------------------------------------------------------
    async def _forward(self, port: int, host_socket: str) -> None:
        """A relay in tunnel mode, as root, on a long-lived channel (``self.tunnel``); another channel
        replaces it when the transport drops (see sandbox.tunnel)."""
        if not self._relay_installed:
            await self._install_relay()
            self._relay_installed = True
        command = shlex.join(["/bin/sh", f"{self.relay_dir}/tunnel.sh", self.relay_dir, str(port),
                              str(self.tunnel_max_streams)])
        tunnel = Tunnel(lambda: self.open_channel(command), host_socket, max_streams=self.tunnel_max_streams)
        try:
            await tunnel.start()
        except Exception as exc:  # the SDK's and asyncssh's own errors too; never the token (not in them)
            with contextlib.suppress(Exception):
                await tunnel.close()
            raise ForwardError(
                f"the {self.tunnel} tunnel for port {port} of sandbox {self.id} did not start: "
                f"{_safe(exc, self._ssh_tokens)}") from None
        self._tunnels[port] = tunnel

    def tunnel_for(self, port: int) -> Tunnel | None:
        """The tunnel serving ``port``, for its counters and tests."""
        return self._tunnels.get(port)

    async def open_channel(self, command: str) -> Channel:
        """A new channel of this sandbox's kind (``self.tunnel``) running the shell command ``command``."""
        if self.tunnel == "pty":
            return await daytona_pty_channel(self._sandbox.process, command,
                                             session_id=f"ares-tunnel-{secrets.token_hex(6)}",
                                             max_message=self.pty_max_message)
        token, host, port = await self._ssh_access()
        return await ssh_exec_channel(host, port, token, command, known_hosts=self.ssh_known_hosts)

    async def _ssh_access(self) -> tuple[str, str, int]:
        """The SSH access in use, or a new one when there is none or it ends within 2 minutes."""
        if self._ssh is not None and self._ssh[3] - time.time() > 120:
            return self._ssh[:3]
        if self._ssh is not None:  # near its end: the channel that used it is being replaced
            await self._revoke_ssh()
        access = await self._sandbox.create_ssh_access(expires_in_minutes=self.ssh_expires_minutes)
        self._ssh_tokens.append(access.token)
        try:
            host, port, user = parse_ssh_command(access.ssh_command)
        except ValueError as exc:
            raise ForwardError(f"sandbox {self.id}: {exc}") from None
        expires = access.expires_at.timestamp() if access.expires_at is not None else time.time() + 60
        self._ssh = (user or access.token, host, port, expires)
        return self._ssh[:3]

    async def _revoke_ssh(self) -> None:
        tokens, self._ssh_tokens, self._ssh = self._ssh_tokens, [], None
        for token in tokens:
            try:
                await _retry(self._sandbox.revoke_ssh_access)(token)
                self.ssh_revoked += 1
            except Exception as exc:
                if getattr(exc, "status_code", None) == 404:  # gone with its sandbox, or expired
                    self.ssh_revoked += 1

    async def _install_relay(self) -> None:
        sdk = _sdk()
        relay, script = _RELAY_SCRIPT.read_bytes(), _TUNNEL_SH.encode()
        tmp = f"/tmp/.ares-relay-{secrets.token_hex(8)}"
        try:
            await self._sandbox.fs.upload_files([sdk.FileUpload(source=relay, destination=f"{tmp}.py"),
                                                 sdk.FileUpload(source=script, destination=f"{tmp}.sh")])
        except sdk.DaytonaError as exc:
            raise ForwardError(f"uploading the relay into sandbox {self.id} failed: {exc}") from exc
        r = await self._exec(shlex.join(["/bin/sh", "-c", _INSTALL, "ares-install", f"{tmp}.py", f"{tmp}.sh",
                                         self.relay_dir]), cwd="/", env={}, user="root", timeout=120)
        if r.exit_code == 3 and "no python3" in r.stdout:
            raise ForwardError(
                f"the image of sandbox {self.id} has no python3, which the tunnel's relay needs: "
                "use an image with python3")
        want = [hashlib.sha256(relay).hexdigest(), hashlib.sha256(script).hexdigest()]
        if not r.ok or r.stdout.split() != want:
            raise ForwardError(f"installing the relay in {self.relay_dir} of sandbox {self.id} failed: "
                               f"{(r.stdout + r.stderr).strip()[-500:] or f'exit {r.exit_code}'}")

    # -- exec ----------------------------------------------------------------------------------------
    async def _raw_exec(self, script: str, timeout: float) -> tuple[int, str]:
        response = await self._sandbox.process.exec(script, timeout=int(timeout) + 1)
        return int(response.exit_code or 0), str(response.result or "")

    async def _exec(
        self, command: str, *, cwd: str, env: dict[str, str], user: str | None, timeout: float | None
    ) -> ExecResult:
        token = secrets.token_hex(12)
        pidfile = token  # the record's name in the wrapper's own directory
        boundary = f"\n<<ares-stderr-{token}>>\n"
        exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in env.items())
        args = [token, boundary, cwd, user or "", exports + command, RECORD_AND_EXEC]
        script = shlex.join(["/bin/sh", "-c", _WRAPPER, "ares-exec", *args])
        backstop = int(timeout + 60) if timeout else 24 * 3600
        started = time.monotonic()
        call = asyncio.ensure_future(self._sandbox.process.exec(script, timeout=backstop))
        timed_out = False
        try:
            response = await asyncio.wait_for(asyncio.shield(call), timeout)
        except TimeoutError:
            timed_out = True
            await self._kill(pidfile)
            try:
                response = await asyncio.wait_for(call, 15)
            except Exception:
                response = None
        except asyncio.CancelledError:
            await self._kill(pidfile)
            call.cancel()
            raise
        except Exception as exc:
            raise ExecError(f"Daytona exec in sandbox {self.id} failed: {exc}") from exc
        if response is None:
            stdout, stderr, code = "", "", -9
        else:
            combined = str(response.result or "")
            stdout, sep, stderr = combined.rpartition(boundary)
            if not sep:
                stdout, stderr = combined, ""
            code = int(response.exit_code) if response.exit_code is not None else -1
        if code == _CWD_MISSING and stderr.startswith("ares-exec: no such directory"):
            raise ExecError(f"cwd {cwd!r} does not exist in sandbox {self.id}: create it first (mkdir -p)")
        return ExecResult(
            stdout=stdout,
            stderr=stderr,
            exit_code=-9 if timed_out else code,
            timed_out=timed_out,
            duration=time.monotonic() - started,
        )

    async def _kill(self, pidfile: str) -> None:
        with contextlib.suppress(Exception):
            await self._raw_exec(shlex.join(["/bin/sh", "-c", _KILL, pidfile]), timeout=30)

    async def _shell(self, script: str, what: str) -> None:
        code, output = await self._raw_exec(shlex.join(["/bin/sh", "-c", script]), timeout=600)
        if code != 0:
            raise FileTransferError(f"{what} in sandbox {self.id} failed: {output.strip()}")

    # -- files --------------------------------------------------------------------------------------
    async def _upload_file(self, local_path: Path, remote_path: str) -> None:
        sdk = _sdk()
        if not await asyncio.to_thread(local_path.is_file):
            raise FileTransferError(f"{local_path} is not a file: pass an existing local file")
        parent = posixpath.dirname(remote_path)
        await self._shell(f"mkdir -p {shlex.quote(parent)}", f"creating {parent}")
        try:
            await self._sandbox.fs.upload_files(
                [sdk.FileUpload(source=str(local_path), destination=remote_path)])
        except sdk.DaytonaError as exc:
            raise FileTransferError(f"uploading {local_path} to {remote_path} failed: {exc}") from exc

    async def _upload_dir(self, local_dir: Path, remote_dir: str) -> None:
        sdk = _sdk()
        tar_stream = await asyncio.to_thread(tar_directory, local_dir)
        remote_tar = f"/tmp/.ares-upload-{secrets.token_hex(8)}.tar"
        try:
            data = await asyncio.to_thread(tar_stream.read)
        finally:
            tar_stream.close()
        try:
            await self._sandbox.fs.upload_files([sdk.FileUpload(source=data, destination=remote_tar)])
        except sdk.DaytonaError as exc:
            raise FileTransferError(f"uploading {local_dir} to {remote_dir} failed: {exc}") from exc
        q, t = shlex.quote(remote_dir), shlex.quote(remote_tar)
        await self._shell(f"mkdir -p {q} && tar -xf {t} -C {q}; rc=$?; rm -f {t}; exit $rc",
                          f"unpacking into {remote_dir}")

    async def _download_file(self, remote_path: str, local_path: Path) -> None:
        sdk = _sdk()
        await asyncio.to_thread(local_path.parent.mkdir, parents=True, exist_ok=True)
        try:
            results = await self._sandbox.fs.download_files(
                [sdk.FileDownloadRequest(source=remote_path, destination=str(local_path))]
            )
        except sdk.DaytonaError as exc:
            raise FileTransferError(f"downloading {remote_path} failed: {exc}") from exc
        if not results or results[0].error:
            reason = results[0].error if results else "no answer"
            raise FileTransferError(f"downloading {remote_path} from sandbox {self.id} failed: {reason}")

    async def _download_dir(self, remote_dir: str, local_dir: Path) -> None:
        remote_tar = f"/tmp/.ares-download-{secrets.token_hex(8)}.tar"
        q, t = shlex.quote(remote_dir), shlex.quote(remote_tar)
        await self._shell(f"[ -d {q} ] && tar -cf {t} -C {q} .", f"archiving {remote_dir}")
        with tempfile.TemporaryDirectory() as tmp:
            local_tar = Path(tmp) / "dir.tar"
            try:
                await self._download_file(remote_tar, local_tar)
            finally:
                with contextlib.suppress(Exception):
                    await self._shell(f"rm -f {t}", "cleaning up")

            def unpack() -> None:
                with open(local_tar, "rb") as fh:
                    extract_tar(fh, local_dir)

            await asyncio.to_thread(unpack)


def _rest_api(config: Any) -> Any:
    import daytona_api_client

    url = config.api_url or "https://app.daytona.io/api"
    api_client = daytona_api_client.ApiClient(daytona_api_client.Configuration(host=url))
    api_client.default_headers["Authorization"] = f"Bearer {config.api_key}"
    return daytona_api_client.SandboxApi(api_client)


def _safe(exc: BaseException, secrets_: list[str]) -> str:
    """An exception's text with any token in it blanked out."""
    text = str(exc) or type(exc).__name__
    for secret in secrets_:
        text = text.replace(secret, "<token>")
    return text


def _revoke_sync(config: Any, sandbox_id: str, tokens: list[str]) -> int:
    """Revoke SSH access tokens through the synchronous REST client; how many are gone. Never raises."""
    import daytona_api_client

    done = 0
    try:
        api = _rest_api(config)
    except Exception:
        return 0
    try:
        for token in tokens:
            try:
                api.revoke_ssh_access(sandbox_id, token=token, _request_timeout=30)
                done += 1
            except daytona_api_client.ApiException as exc:
                done += exc.status == 404
            except Exception:  # the sandbox is deleted next: its accesses go with it
                pass
    finally:
        with contextlib.suppress(Exception):
            api.api_client.close()
    return done


def _delete_sync(config: Any, sandbox_id: str) -> None:
    import daytona_api_client

    api = _rest_api(config)

    @_retry
    def delete() -> None:
        try:
            api.delete_sandbox(sandbox_id, _request_timeout=30)
        except daytona_api_client.ApiException as exc:
            if exc.status == 404:
                return
            raise

    try:
        delete()
    finally:
        with contextlib.suppress(Exception):
            api.api_client.close()


# -- garbage collection hooks (see janitor.collect_garbage) -----------------------------------------


def gc_candidates() -> list[tuple[str, dict[str, str]]]:
    config = _config(None, None, None)
    api = _rest_api(config)
    found: list[tuple[str, dict[str, str]]] = []
    cursor: str | None = None
    while True:
        page = api.list_sandboxes(cursor=cursor, _request_timeout=30)
        for item in page.items:
            labels = dict(item.labels or {})
            if janitor.OWNER_LABEL in labels:
                found.append((str(item.id), labels))
        cursor = page.next_cursor
        if not cursor:
            return found


def gc_remove(ref: str) -> None:
    _delete_sync(_config(None, None, None), ref)
