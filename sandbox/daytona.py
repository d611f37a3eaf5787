"""``DaytonaSandbox``: a remote sandbox on Daytona, driven through the ``daytona`` package's async client.

Install with ``pip install 'ares-gateway[daytona]'`` and set ``DAYTONA_API_KEY`` (and ``DAYTONA_API_URL``
for a self-hosted Daytona).  The sandbox is created from the spec's image, Dockerfile, or Daytona's
default snapshot, with the spec's resources, labels (owner, session, creation time) and auto-stop /
auto-delete intervals as the last line of defence against leaks.

Commands go through the toolbox ``process/execute`` call wrapped in a small POSIX shell script that
runs them in their own session (``setsid``), keeps stderr apart from stdout, switches user with
``runuser``/``sudo`` and records the process-group id; on timeout a second call kills the whole
group inside the sandbox.  Directories travel as one tar archive through the batch file endpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from .errors import BackendUnavailableError, ExecError, FileTransferError, SandboxStartError
from .protocol import BaseSandbox, ExecResult, extract_tar, tar_directory
from .spec import SandboxSpec

_CWD_MISSING = 201
_GIB = 1024**3

# $1 pid file, $2 stderr file, $3 boundary, $4 cwd, $5 user ('' = default), $6 command.
_WRAPPER = r"""
p=$1; e=$2; b=$3; d=$4; u=$5; c=$6
if ! cd -- "$d" 2>/dev/null; then printf '%s' "$b"; echo "ares-exec: no such directory: $d"; exit 201; fi
if [ -z "$u" ]; then set -- /bin/sh -c "$c"
elif [ "$(id -u)" = 0 ]; then set -- runuser -u "$u" -- /bin/sh -c "$c"
else set -- sudo -n -u "$u" -- /bin/sh -c "$c"; fi
if command -v setsid >/dev/null 2>&1; then
  setsid -w /bin/sh -c 'echo $$ >"$0"; exec "$@"' "$p" "$@" 2>"$e" </dev/null; rc=$?
else
  /bin/sh -c 'echo $$ >"$0"; exec "$@"' "$p" "$@" 2>"$e" </dev/null; rc=$?
fi
printf '%s' "$b"; cat "$e" 2>/dev/null; rm -f "$e" "$p"; exit $rc
"""
_KILL = (
    'p=$(cat "$0" 2>/dev/null); [ -n "$p" ] || exit 0; '
    'kill -9 -"$p" 2>/dev/null || kill -9 "$p" 2>/dev/null || sudo -n kill -9 -- -"$p" 2>/dev/null; exit 0'
)


def _sdk() -> Any:
    try:
        import daytona
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise BackendUnavailableError(
            "the Daytona backend needs the daytona package: pip install 'ares-gateway[daytona]'"
        ) from exc
    return daytona


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
            "the Daytona backend needs an API key: set DAYTONA_API_KEY (and DAYTONA_API_URL for a self-hosted "
            "Daytona) or pass api_key="
        )
    url = api_url or os.environ.get("DAYTONA_API_URL") or None
    return sdk.DaytonaConfig(api_key=key, api_url=url, target=target or os.environ.get("DAYTONA_TARGET") or None)


class DaytonaSandbox(BaseSandbox):
    backend = "daytona"

    def __init__(
        self,
        spec: SandboxSpec | None = None,
        *,
        api_key: str | None = None,
        api_url: str | None = None,
        target: str | None = None,
        create_timeout: float = 180.0,
    ) -> None:
        super().__init__(spec)
        self._config = _config(api_key, api_url, target)
        self.create_timeout = create_timeout
        self._client: Any = None
        self._sandbox: Any = None
        self.remote_id: str | None = None
        self._name = f"ares-sbx-{self.id}"

    @property
    def description(self) -> str:
        where = self._config.api_url or "Daytona cloud"
        return f"daytona sandbox {self.id} (remote id {self.remote_id}, {where}, network={self.spec.network})"

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
            f"{{ sudo -n mkdir -p {shlex.quote(self.spec.workdir)} && sudo -n chown \"$(id -u)\" {shlex.quote(self.spec.workdir)}; }}",
            timeout=60,
        )
        if prep[0] != 0:
            raise SandboxStartError(f"cannot create workdir {self.spec.workdir} in the Daytona sandbox: {prep[1]}")

    async def _stop(self) -> None:
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
        _delete_sync(self._config, self.remote_id or self._name)

    # -- exec ----------------------------------------------------------------------------------------
    async def _raw_exec(self, script: str, timeout: float) -> tuple[int, str]:
        response = await self._sandbox.process.exec(script, timeout=int(timeout) + 1)
        return int(response.exit_code or 0), str(response.result or "")

    async def _exec(
        self, command: str, *, cwd: str, env: dict[str, str], user: str | None, timeout: float | None
    ) -> ExecResult:
        token = secrets.token_hex(12)
        pidfile, errfile = f"/tmp/.ares-exec-{token}.pid", f"/tmp/.ares-exec-{token}.err"
        boundary = f"\n<<ares-stderr-{token}>>\n"
        exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in env.items())
        args = [pidfile, errfile, boundary, cwd, user or "", exports + command]
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
            await self._sandbox.fs.upload_files([sdk.FileUpload(source=str(local_path), destination=remote_path)])
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
        await self._shell(f"mkdir -p {q} && tar -xf {t} -C {q}; rc=$?; rm -f {t}; exit $rc", f"unpacking into {remote_dir}")

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
