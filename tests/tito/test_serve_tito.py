"""``ares-gateway serve --policy tito``: a real serve process answers an agent with the real model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

from tests.helpers import free_port
from tests.tito.conftest import need_llama

ADMIN = "serve-tito-admin-token-0123456789"


def _call(url: str, body: dict, token: str) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"authorization": f"Bearer {token}",
                                          "content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def test_serve_answers_with_the_tito_policy() -> None:
    need_llama()
    from openai import OpenAI

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ares_gateway.cli", "serve", "--port", str(port), "--in-memory",
         "--policy", "tito", "--max-tokens", "12", "--seed", "7"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "ARES_GATEWAY_ADMIN_TOKEN": ADMIN},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                with urllib.request.urlopen(url + "/healthz", timeout=1):
                    break
            except OSError:
                assert time.time() < deadline, "serve did not come up"
                time.sleep(0.2)
        info = _call(url + "/sessions", {}, ADMIN)
        client = OpenAI(base_url=info["base_url"] + "/v1", api_key=info["token"], max_retries=0, timeout=90)
        reply = client.chat.completions.create(model="smol",
                                               messages=[{"role": "user", "content": "Say hello."}])
        assert reply.choices[0].message.content, reply
        req = urllib.request.Request(f"{url}/sessions/{info['session_id']}/turns",
                                     headers={"authorization": f"Bearer {ADMIN}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            turns = json.load(r)
        tokens = turns[0]["completion"]["tokens"]
        # The engine's own sample: at most --max-tokens ids, each with its logprob, after the rendered prompt.
        assert 0 < len(tokens["output_ids"]) <= 12 and len(tokens["output_logprobs"]) == len(
            tokens["output_ids"])
        assert len(tokens["prompt_ids"]) > 5 and all(lp <= 0 for lp in tokens["output_logprobs"])
        assert turns[0]["completion"]["extra"]["tito"]["sampling"]["max_tokens"] == 12
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert ADMIN not in out, "the admin token was printed"
    assert "answering every session with the tito policy" in out, out
