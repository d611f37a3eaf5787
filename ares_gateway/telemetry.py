"""OpenTelemetry spans: one per episode, one per answered LLM call, with OpenInference's LLM attributes.

Optional (the ``otel`` extra: ``opentelemetry-sdk`` and ``opentelemetry-exporter-otlp-proto-http``) and
off by default. :meth:`Telemetry.from_env` turns it on when the standard ``OTEL_*`` environment asks
for traces (``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or
``OTEL_TRACES_EXPORTER`` set; ``OTEL_TRACES_EXPORTER=none`` or ``OTEL_SDK_DISABLED=true`` keep it off);
the SDK itself reads the endpoint, headers, timeouts, batching and ``OTEL_SERVICE_NAME`` /
``OTEL_RESOURCE_ATTRIBUTES``. Spans go to a :class:`TracerProvider` of their own (never the process's
global one, which another library may have set up).

Each LLM call's span starts when the request arrived and ends when its answer ended, with
``openinference.span.kind=LLM``, ``llm.model_name``, ``llm.token_count.{prompt,completion,total}``
(the turn log's counts: the renderer's token record, else the upstream's ``usage``) and
``ares.session_id``, ``ares.request_id``, ``ares.parked_seconds``, ``ares.policy_seconds``,
``ares.ttft_seconds``, ``ares.policy_version``, ``ares.side_call``. It is a child of its episode's span
when the session belongs to an episode (:meth:`Telemetry.episode`), else a root span carrying the
session id. Message contents (``input.value``, ``output.value``) only with ``record_content=True``:
requests can hold secrets.

opentelemetry is imported only when telemetry is built, so the gateway works without the extra.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import orjson

from ares_gateway.core.recorder import RecordedTurn, token_counts

log = logging.getLogger(__name__)

__all__ = ["EpisodeSpan", "Telemetry", "TelemetryUnavailableError"]

_NS = 1_000_000_000


class TelemetryUnavailableError(RuntimeError):
    """OpenTelemetry was asked for but the ``otel`` extra is not installed (or is configured for an
    exporter this project does not ship)."""


def _env_wants_traces(env: Mapping[str, str]) -> bool:
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    return bool(exporter or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def _exporters_from_env(env: Mapping[str, str]) -> list[Any]:
    """The span exporters ``OTEL_TRACES_EXPORTER`` names (default ``otlp``), built by the SDK's classes,
    which read their own ``OTEL_EXPORTER_OTLP_*`` settings."""
    names = [n.strip().lower() for n in (env.get("OTEL_TRACES_EXPORTER") or "otlp").split(",") if n.strip()]
    out: list[Any] = []
    for name in names:
        if name == "none":
            continue
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            out.append(ConsoleSpanExporter())
        elif name == "otlp":
            protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                        or "http/protobuf").strip().lower()
            if protocol != "http/protobuf":
                raise TelemetryUnavailableError(
                    f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: the otel extra ships the OTLP/HTTP exporter "
                    "only; set it to http/protobuf (the collector's port 4318) or install and configure "
                    "grpc yourself")
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            except ImportError as exc:
                raise TelemetryUnavailableError(
                    "OTLP export needs the otel extra: pip install 'ares-gateway[otel]'") from exc
            out.append(OTLPSpanExporter())
        else:
            raise TelemetryUnavailableError(
                f"OTEL_TRACES_EXPORTER={name!r} is not supported here: use otlp, console or none")
    return out


class Telemetry:
    """Emits the gateway's OpenTelemetry spans (see the module docstring). A
    :class:`~ares_gateway.core.recorder.Recorder`:
    the gateway hands it every answered turn.

    Args:
        tracer_provider: where spans go (an SDK ``TracerProvider``; a test passes one with an in-memory
            exporter). ``None``: a new provider with the exporters the ``OTEL_*`` environment names.
        record_content: put the request body (``input.value``) and the answer (``output.value``) on
            each LLM span. Off by default: they can hold secrets.
        env: the environment read (default ``os.environ``).
    """

    def __init__(self, *, tracer_provider: Any = None, record_content: bool = False,
                 env: Mapping[str, str] | None = None) -> None:
        try:
            from opentelemetry import trace
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            raise TelemetryUnavailableError(
                "OpenTelemetry spans need the otel extra: pip install 'ares-gateway[otel]'") from exc
        self._trace = trace
        self._owned = tracer_provider is None
        if tracer_provider is None:
            # Resource.create() (the default) reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES.
            tracer_provider = TracerProvider()
            for exporter in _exporters_from_env(os.environ if env is None else env):
                tracer_provider.add_span_processor(BatchSpanProcessor(exporter))
        self.provider = tracer_provider
        self.tracer = tracer_provider.get_tracer("ares_gateway")
        self.record_content = record_content
        self._episodes: dict[str, Any] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, *, enabled: bool | None = None, record_content: bool | None = None,
                 env: Mapping[str, str] | None = None) -> Telemetry | None:
        """Telemetry as the ``OTEL_*`` environment asks (``enabled=None``), forced on (``True``: the OTLP
        exporter's default endpoint when none is set) or off (``False``). ``None`` when off.
        ``record_content=None``: as ``ARES_OTEL_RECORD_CONTENT`` says (``1``/``true``; default off).

        Raises :class:`TelemetryUnavailableError` for an exporter setting this project cannot serve, and
        when forced on without the extra; asked for only by the environment (which other tools share)
        without the extra installed, it is a warning and no spans."""
        env = os.environ if env is None else env
        if enabled is False or (enabled is None and not _env_wants_traces(env)):
            return None
        if record_content is None:
            record_content = env.get("ARES_OTEL_RECORD_CONTENT", "").strip().lower() in ("1", "true", "yes")
        try:
            return cls(record_content=record_content, env=env)
        except TelemetryUnavailableError as exc:
            # a wrong setting is an error either way
            if enabled or not isinstance(exc.__cause__, ImportError):
                raise
            log.warning("OTEL_* asks for traces but no spans will be sent: %s", exc)
            return None

    # ------------------------------------------------------------------ episodes

    @contextlib.contextmanager
    def episode(self, *, task: str, attempt: int, harness: str) -> Iterator[EpisodeSpan]:
        """A span for one episode; the LLM calls of the session :meth:`EpisodeSpan.bind` names become
        its children. Set its outcome with :meth:`EpisodeSpan.finish`."""
        span = self.tracer.start_span(f"episode {task}.{attempt}", attributes={
            "openinference.span.kind": "AGENT", "ares.task": task, "ares.attempt": attempt,
            "ares.harness": harness})
        handle = EpisodeSpan(self, span)
        try:
            yield handle
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            if handle.session_id is not None:
                with self._lock:
                    self._episodes.pop(handle.session_id, None)
            span.end()

    # ------------------------------------------------------------------ LLM calls

    def __call__(self, turn: RecordedTurn) -> None:
        """One LLM span for an answered turn (its timing is the turn's: arrival to answer end)."""
        with self._lock:
            parent = self._episodes.get(turn.session_id)
        context = self._trace.set_span_in_context(parent) if parent is not None else None
        completion = turn.completion
        prompt, output = token_counts(completion)
        attrs: dict[str, Any] = {
            "openinference.span.kind": "LLM",
            "ares.session_id": turn.session_id,
            "ares.request_id": turn.request_id,
            "ares.protocol": turn.protocol.value,
            "ares.side_call": turn.side_call,
        }
        model = completion.model or getattr(turn.request, "model", None)
        if model:
            attrs["llm.model_name"] = str(model)
        if prompt is not None:
            attrs["llm.token_count.prompt"] = prompt
        if output is not None:
            attrs["llm.token_count.completion"] = output
        if prompt is not None and output is not None:
            attrs["llm.token_count.total"] = prompt + output
        for key, value in (("ares.parked_seconds", turn.parked_seconds),
                           ("ares.policy_seconds", turn.policy_seconds),
                           ("ares.ttft_seconds", turn.ttft), ("ares.policy_version", turn.policy_version)):
            if value is not None:
                attrs[key] = value
        if completion.finish_reason:
            attrs["ares.finish_reason"] = str(completion.finish_reason)
        if self.record_content:
            attrs["input.value"] = orjson.dumps(turn.native_request()).decode()
            attrs["input.mime_type"] = "application/json"
            attrs["output.value"] = orjson.dumps(completion.to_message().to_chat_dict()).decode()
            attrs["output.mime_type"] = "application/json"
        start = int(turn.timestamp * _NS)
        span = self.tracer.start_span("llm.call", context=context, attributes=attrs, start_time=start)
        span.end(end_time=max(start, int((turn.timestamp + turn.latency) * _NS)))

    def shutdown(self) -> None:
        """Flush and stop the exporters of a provider this object made (a passed-in provider is its
        owner's)."""
        if self._owned:
            try:
                self.provider.shutdown()
            except Exception:  # an unreachable collector must not fail the gateway's close
                log.warning("OpenTelemetry: flushing the spans failed", exc_info=True)


class EpisodeSpan:
    """An episode's open span (:meth:`Telemetry.episode`)."""

    def __init__(self, telemetry: Telemetry, span: Any) -> None:
        self._telemetry = telemetry
        self.span = span
        self.session_id: str | None = None

    def bind(self, session_id: str) -> None:
        """The episode's session: its LLM calls' spans become this span's children."""
        self.session_id = session_id
        self.span.set_attribute("ares.session_id", session_id)
        with self._telemetry._lock:
            self._telemetry._episodes[session_id] = self.span

    def finish(self, *, reward: float | None, exit_reason: str | None, turns: int,
               error: str | None = None) -> None:
        """The episode's outcome, as attributes (an error also as the span's status)."""
        if reward is not None:
            self.span.set_attribute("ares.reward", float(reward))
        if exit_reason:
            self.span.set_attribute("ares.exit_reason", str(exit_reason))
        self.span.set_attribute("ares.turns", turns)
        if error:
            trace = self._telemetry._trace
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, error))
