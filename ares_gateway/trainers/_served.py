"""The trainer's engine served to episodes that run in other processes (a Ray executor's node actors).

An executor that runs episodes elsewhere (:class:`~ares_gateway.episodes.ray.RayExecutor`) sends the
policy to each worker by value. The trainer's model cannot travel (it is being trained, here), so the
adapter serves its in-process engine with :class:`~ares_gateway.engines.engine_server.EngineServer` and hands
the executor a :class:`RemoteTitoPolicy`: the same tokenizer, renderer and sampling as the local
policy, over :class:`~ares_gateway.engines.sglang.SGLangEngine` at the server's URL. Every worker's
turns are then sampled by the trainer's live weights, in this process, and the logprobs are the
engine's own, exactly as on the local path.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

from ares_gateway.engines.engine_server import MAX_NEW_TOKENS_CAP, EngineServer
from ares_gateway.engines.sglang import SGLangEngine
from ares_gateway.policies.tito import TitoPolicy
from ares_gateway.trainers.episodes import TrainerError

__all__ = ["RemoteTitoPolicy", "ServedEngine"]


class RemoteTitoPolicy(TitoPolicy):
    """A :class:`TitoPolicy` over ``SGLangEngine(url)`` that pickles as its recipe.

    Pickled (cloudpickle, to a Ray actor), it is the URL, the bearer header, the tokenizer source, the
    renderer name, the model name and the sampling options, a few hundred bytes: the worker rebuilds the
    renderer from ``tokenizer`` (a path every node must be able to read, like the task folders) and opens
    its own HTTP connections. No renderer state, session or socket of this process travels.

    Args:
        url: the :class:`EngineServer`'s base URL.
        tokenizer / renderer: as :class:`TitoPolicy`'s (a renderer *name*, or ``None``: by model).
        model: the model name the turn records carry (the served engine's).
        headers: request headers (the server's ``Authorization: Bearer``); they travel with the policy.
        sampling: :class:`TitoPolicy`'s sampling options (``max_tokens``, ``temperature``, ``top_p``,
        ``top_k``, ``seed``).
    """

    def __init__(self, url: str, *, tokenizer: str, renderer: str | None = None, model: str = "",
                 headers: Mapping[str, str] | None = None, **sampling: Any) -> None:
        self._recipe: dict[str, Any] = {"url": url, "tokenizer": tokenizer, "renderer": renderer,
                                        "model": model, "headers": dict(headers or {}), **sampling}
        engine = SGLangEngine(url, model=model, headers=dict(headers or {}))
        super().__init__(engine, tokenizer=tokenizer, renderer=renderer, **sampling)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (dict(self._recipe),))


def _rebuild(recipe: dict[str, Any]) -> RemoteTitoPolicy:
    recipe = dict(recipe)
    return RemoteTitoPolicy(recipe.pop("url"), **recipe)


class ServedEngine:
    """An in-process engine on an :class:`EngineServer` and the :class:`RemoteTitoPolicy` over it.

    Args:
        host / port: where the server listens (default ``127.0.0.1``, a free port). On a cluster give
            this machine's address that the worker nodes reach: it is the URL the policy carries.
        server_options: more :class:`EngineServer` options (``max_requests``, ``max_body_bytes``, ...).

    The server requires a bearer token drawn here (the workers' policies carry it), so another process
    reaching the port cannot sample the model.
    """

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0,
                 server_options: Mapping[str, Any] | None = None) -> None:
        if not host:
            raise ValueError(
                "engine_host must be an address to listen on (127.0.0.1, or this machine's cluster address)")
        if not 0 <= port < 65536:
            raise ValueError(f"engine_port must be in [0, 65535] (0: a free port), got {port}")
        self.host = host
        self.port = port
        self.server_options = dict(server_options or {})
        self._token = secrets.token_urlsafe(32)
        self.server: EngineServer | None = None
        self.policy: RemoteTitoPolicy | None = None

    async def policy_for(self, engine: Any, *, tokenizer: str, renderer: str | None,
                         sampling: Mapping[str, Any]) -> RemoteTitoPolicy:
        """The remote policy over ``engine`` served; the same server and policy while the engine is the
        same."""
        if self.server is not None and self.server.engine is engine and self.policy is not None:
            return self.policy
        await self.aclose()  # a new engine (a new model object): serve that one instead
        options = dict(self.server_options)
        # The server's cap on new tokens must admit what the trainer's own sampling asks for.
        options.setdefault("max_new_tokens", max(MAX_NEW_TOKENS_CAP, int(sampling.get("max_tokens") or 0)))
        server = EngineServer(engine, host=self.host, port=self.port, api_key=self._token, **options)
        try:
            await server.start()
        except OSError as exc:  # the port is taken, the address is not this machine's
            raise TrainerError(
                f"could not serve the trainer's engine on {self.host}:{self.port} "
                f"({exc.strerror or exc}): give "
                "rollout_func an engine_host that is an address of this machine (and engine_port=0 for "
                "a free port)"
            ) from exc
        self.server = server
        self.policy = RemoteTitoPolicy(server.url, tokenizer=tokenizer, renderer=renderer,
                                       model=str(getattr(engine, "model", "")),
                                       headers={"Authorization": f"Bearer {self._token}"}, **dict(sampling))
        return self.policy

    async def aclose(self) -> None:
        """Stop the server and close this process's copy of the policy (the engine stays open)."""
        policy, self.policy = self.policy, None
        server, self.server = self.server, None
        if policy is not None:
            await policy.aclose()
        if server is not None:
            await server.close()
