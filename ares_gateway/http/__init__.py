"""The gateway's HTTP layer, by job.

* :mod:`~ares_gateway.http.server`: aiohttp's low-level server and the limits on what a
  connection may send (:class:`HttpLimits`), reading a body within them;
* :mod:`~ares_gateway.http.routes`: the route table (one dict lookup per request);
* :mod:`~ares_gateway.http.app`: every path of one gateway, and the server around them;
* :mod:`~ares_gateway.http.agent_api`: the LLM APIs agents call (auth → parse → park → await → render);
* :mod:`~ares_gateway.http.control_api`: sessions, ``/poll``, ``/respond``, health and metrics;
* :mod:`~ares_gateway.http.render`: answers as JSON bodies, error shapes and SSE streams.
"""

from ares_gateway.http.server import HttpLimits, HttpServer

__all__ = ["HttpLimits", "HttpServer"]
