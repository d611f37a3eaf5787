"""The gateway's core: what happens to an agent's request between its parsing and its rendering.

It knows no HTTP and no CLI, runs no episode and holds no policy (see tests/test_layout.py):

* :mod:`~ares_gateway.core.canonical`: the protocol-neutral request and completion models;
* :mod:`~ares_gateway.core.wire`: the interface a wire protocol implements, and where its adapter is found;
* :mod:`~ares_gateway.core.answers`: what a policy may answer with, read into one answer;
* :mod:`~ares_gateway.core.broker`: parked requests, leases to pollers, timeouts, exactly-once answers;
* :mod:`~ares_gateway.core.sessions`: sessions, their tokens and the one turn counter;
* :mod:`~ares_gateway.core.recorder`: the one place a turn, whole or streamed, is recorded;
* :mod:`~ares_gateway.core.record_codec`: the turn record's written, versioned format;
* :mod:`~ares_gateway.core.session_recorder`: the default recorder: sessions' samples, turn logs, lifecycle;
* :mod:`~ares_gateway.core.streaming`: a stream's deltas added up into a whole completion;
* :mod:`~ares_gateway.core.metrics`: the gateway's Prometheus counters;
* :mod:`~ares_gateway.core.errors`: the whole exception tree.

This module re-exports nothing: the protocols import :mod:`~ares_gateway.core.canonical`, and
:mod:`~ares_gateway.core.answers` imports the protocols.
"""
