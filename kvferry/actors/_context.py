"""Context that travels with a message from one actor to the next.

A handler runs in its actor's task, not in the sender's, so neither the sender's
OpenTelemetry span nor its structlog context variables would reach it by themselves.
``tell`` and ``ask`` therefore capture both when the message is sent (:func:`capture`)
and put them in the mailbox envelope beside the message; the receiving actor applies
them around its handler (:class:`HopScope`). A span started in the handler is then a
child of the sender's span, and a log line written there carries the sender's bound keys
(a ``req_id`` bound once at the edge follows the request through every actor).

Two keys are the receiver's own and are never carried: ``actor`` (bound once in the
actor's task) and ``message`` (bound per message to the message's type name).

Who owns what: a :data:`Hop` is immutable and created on the sender's task; a
:class:`HopScope` is entered and exited by the receiving actor's task, around one handler.
Library code only uses the OpenTelemetry API; the tracer provider is injected.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

_OWN_KEYS = frozenset({"actor", "message"})

Hop: TypeAlias = tuple[otel_context.Context | None, dict[str, Any] | None]
"""What travels beside a message: the sender's OpenTelemetry context, its structlog vars."""


def capture() -> Hop | None:
    """The caller's context worth carrying, or None when there is nothing (the common case).

    Costs about a microsecond; None keeps the receiving side on its fast path.
    """
    otel = otel_context.get_current()
    logvars = structlog.contextvars.get_contextvars()
    if logvars:
        for key in _OWN_KEYS & logvars.keys():
            del logvars[key]
    if not otel and not logvars:
        return None
    return (otel or None, logvars or None)


class HopScope:
    """Applies a :data:`Hop` (and, if tracing, a ``handle message`` span) around one handler.

    Used as ``with HopScope(...) as scope: ...; scope.fail(exc)`` by the actor's own task,
    and (without a message) by the sync runtimes' call server, so a call made on the
    engine thread runs in the engine thread's span and log context.
    """

    __slots__ = ("_hop", "_tracer", "_actor", "_message", "_span", "_otel_token", "_log_tokens")

    def __init__(
        self,
        hop: Hop | None,
        tracer: trace.Tracer | None = None,
        actor: str = "",
        message: str | None = None,
    ) -> None:
        self._hop = hop
        self._tracer = tracer
        self._actor = actor
        self._message = message
        self._span: trace.Span | None = None
        self._otel_token: object = None
        self._log_tokens: Any = None

    def __enter__(self) -> HopScope:
        otel, logvars = self._hop if self._hop is not None else (None, None)
        bound = dict(logvars) if logvars else {}
        if self._message is not None:
            bound["message"] = self._message
        if bound:
            self._log_tokens = structlog.contextvars.bind_contextvars(**bound)
        ctx = otel
        if self._tracer is not None and self._message is not None:
            self._span = self._tracer.start_span(
                "handle message",
                context=otel,
                attributes={"kvferry.actor": self._actor, "kvferry.message": self._message},
            )
            ctx = trace.set_span_in_context(self._span, otel)
        if ctx is not None:
            self._otel_token = otel_context.attach(ctx)
        return self

    def fail(self, error: BaseException) -> None:
        """Mark the hop's span failed (the handler raised)."""
        if self._span is not None:
            self._span.record_exception(error)
            self._span.set_status(Status(StatusCode.ERROR))

    def __exit__(self, *exc_info: object) -> None:
        if self._otel_token is not None:
            otel_context.detach(self._otel_token)  # type: ignore[arg-type]
        if self._span is not None:
            self._span.end()
        if self._log_tokens is not None:
            structlog.contextvars.reset_contextvars(**self._log_tokens)
