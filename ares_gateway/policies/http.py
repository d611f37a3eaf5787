"""The ``http`` policy: requests stay parked for an external trainer polling ``GET /poll``.

It answers nothing itself. :class:`~ares_gateway.policies.base.PolicyServer` sees ``external`` and
starts no loop; the trainer answers with ``POST /respond`` (see docs/gateway.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

from ares_gateway.policies.base import PolicyRequest


@dataclass(frozen=True)
class HttpPolicy:
    """A marker: leave every request parked for ``/poll`` + ``/respond``."""

    external: bool = True

    def describe(self, gateway_url: str, *, admin_token_set: bool = False) -> str:
        """One line telling a user where to point the trainer."""
        auth = " with 'Authorization: Bearer <admin token>'" if admin_token_set else ""
        return (
            f"requests wait for an external policy: GET {gateway_url}/poll and POST "
            f"{gateway_url}/respond{auth}"
        )

    def __call__(self, request: PolicyRequest, /) -> NoReturn:
        raise RuntimeError(
            "the http policy answers nothing in process: an external trainer answers through /poll "
            "and /respond (PolicyServer starts no loop for it)"
        )
