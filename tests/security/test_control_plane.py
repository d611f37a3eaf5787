"""The control plane opens only with the admin token, the per-session agent socket serves
one session's LLM endpoints and nothing else, and ``serve`` never runs open."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from ares_gateway import Gateway

ADMIN = "admin-" + "x" * 32


async def test_control_api_needs_the_admin_token_and_is_no_token_oracle() -> None:
    async with Gateway(port=0, admin_token=ADMIN) as gw:
        a = await gw.create_session()
        b = await gw.create_session()
        async with aiohttp.ClientSession() as http:
            for auth in (None, a.token, "admin", "ags-" + "A" * 32):
                headers = {"Authorization": f"Bearer {auth}"} if auth else {}
                for method, path, body in (
                    ("GET", "/poll?wait=0", None), ("GET", "/sessions", None), ("GET", "/metrics", None),
                    ("POST", "/respond", {"id": "req_1", "completion": {"text": "x"}}),
                    ("POST", f"/sessions/{b.session_id}/end", {"reward": 1.0}),
                    ("GET", f"/sessions/{b.session_id}/turns", None),
                    ("DELETE", f"/sessions/{b.session_id}", None),
                    # Probing whether a token is in use: a 401 whether it is (a's) or not.
                    ("POST", "/sessions", {"token": a.token}),
                    ("POST", "/sessions", {"token": "ags-" + "C" * 32}),
                ):
                    async with http.request(method, gw.url + path, json=body, headers=headers) as r:
                        assert r.status == 401, (method, path, auth, r.status)
            assert not gw.sessions.get(b.session_id).ended
            async with http.post(gw.url + "/sessions", json={"token": a.token},
                                 headers={"Authorization": f"Bearer {ADMIN}"}) as r:
                assert r.status == 409  # the admin may learn it; nobody else can ask


async def test_session_socket_serves_only_its_session() -> None:
    tmp_path = Path(tempfile.mkdtemp(prefix="h9-", dir="/tmp"))  # short: sun_path holds 108 bytes
    async with Gateway(port=0, admin_token=ADMIN, runtime_dir=str(tmp_path / "rt")) as gw:
        a = await gw.create_session()
        b = await gw.create_session()
        path = await gw.agent_socket(a.session_id)
        assert path == str(tmp_path / "rt" / a.session_id / "agent.sock")
        assert stat.S_IMODE(os.stat(Path(path).parent).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert await gw.agent_socket(a.session_id) == path  # idempotent
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path)) as http:
            async def status(method: str, p: str, token: str | None = a.token, admin: bool = False) -> int:
                headers = {"Authorization": f"Bearer {ADMIN if admin else token}"} if (token or admin) else {}
                async with http.request(method, "http://sandbox" + p, headers=headers) as r:
                    return r.status

            assert await status("GET", "/v1/models") == 200
            assert await status("GET", f"/s/{a.session_id}/v1/models") == 200
            assert await status("HEAD", "/", token=None) == 200
            assert await status("GET", "/v1/models", token=b.token) == 401  # another session's token
            assert await status("GET", f"/s/{b.session_id}/v1/models", token=b.token) == 404
            for p in ("/poll", "/sessions", "/metrics", "/healthz", f"/sessions/{a.session_id}",
                      f"/sessions/{a.session_id}/turns"):
                assert await status("GET", p, admin=True) == 404, p  # no control API here, admin or not
            assert await status("POST", "/respond", admin=True) == 404
        await gw.delete_session(a.session_id)
        assert os.listdir(tmp_path / "rt") == []  # a's socket and directory are gone
    assert not (tmp_path / "rt" / b.session_id).exists()
    shutil.rmtree(tmp_path)


@pytest.mark.parametrize("in_memory", [True, False])
def test_serve_without_admin_token_generates_one(tmp_path: Path, in_memory: bool) -> None:
    """The token file is written beside the data it guards (the state home with --in-memory), never the
    cwd."""
    env = {k: v for k, v in os.environ.items() if k != "ARES_GATEWAY_ADMIN_TOKEN"}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ares_gateway.cli", "serve", "--port", "0",
         *(["--in-memory"] if in_memory else [])],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
    )
    try:
        assert proc.stdout is not None
        line = ""
        while "admin token" not in line:
            line = proc.stdout.readline()
            assert line, "serve exited"
        home = tmp_path / "state" / "ares-gateway"
        # Without --in-memory, with --port 0: the default data dir of this serve process.
        token_file = (home if in_memory else home / f"data-pid{proc.pid}") / "admin-token"
        assert f"admin token required: generated, in {token_file}" in line, line
        assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
        token = token_file.read_text().strip()
        assert len(token) >= 32 and token not in line
        url = line.split("listening on ", 1)[1].split()[0]
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url + "/sessions", timeout=10)
        assert refused.value.code == 401
        req = urllib.request.Request(url + "/sessions", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert token not in out
    assert not (tmp_path / "ares-data").exists(), "a token file was written in the working directory"
