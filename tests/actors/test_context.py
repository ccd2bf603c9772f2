"""Context across hops: the sender's span and structlog context travel with the message."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import attrs
import pytest
import structlog
from opentelemetry import trace

from kvferry._logging import get_logger
from kvferry.actors import Actor, ActorRef, ActorSystem, Reply, start_runtime
from kvferry.actors._testing import recorded_spans

pytestmark = pytest.mark.anyio


@attrs.frozen(kw_only=True)
class Go:
    pass


@attrs.frozen(kw_only=True)
class Work:
    reply: Reply[None] | None = attrs.field(default=None, eq=False, repr=False)


class Back(Actor[Work]):
    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer = tracer
        self.done = anyio.Event()

    async def handle(self, msg: Work) -> None:
        with self.tracer.start_as_current_span("back work"):
            get_logger("tests.actors").info("back_handled")
        if msg.reply is not None:
            msg.reply.set(None)
        self.done.set()


class Front(Actor[Go]):
    def __init__(self, back: ActorRef[Work], tracer: trace.Tracer) -> None:
        self.back = back
        self.tracer = tracer

    async def handle(self, msg: Go) -> None:
        with self.tracer.start_as_current_span("front work"):
            get_logger("tests.actors").info("front_handled")
            await self.back.tell(Work())


def by_name(exporter: Any) -> dict[str, Any]:
    spans = exporter.get_finished_spans()
    names = [s.name for s in spans]
    assert len(set(names)) == len(names), names
    return {s.name: s for s in spans}


async def test_a_span_started_in_one_actor_is_the_parent_of_the_span_of_the_actor_it_told() -> None:
    provider, exporter = recorded_spans()
    tracer = provider.get_tracer("tests")
    async with ActorSystem() as system:
        back_actor = Back(tracer)
        back = await system.spawn(back_actor)
        front = await system.spawn(Front(back, tracer))
        await front.tell(Go())
        await back_actor.done.wait()
    spans = by_name(exporter)
    front_span, back_span = spans["front work"], spans["back work"]
    assert back_span.parent is not None
    assert back_span.parent.span_id == front_span.context.span_id
    assert back_span.context.trace_id == front_span.context.trace_id


async def test_with_a_tracer_provider_every_hop_gets_a_handle_message_span() -> None:
    provider, exporter = recorded_spans()
    tracer = provider.get_tracer("tests")
    async with ActorSystem(tracer_provider=provider) as system:
        back_actor = Back(tracer)
        back = await system.spawn(back_actor, name="back")
        front = await system.spawn(Front(back, tracer), name="front")
        with tracer.start_as_current_span("request"):
            await front.tell(Go())
        await back_actor.done.wait()
    spans = exporter.get_finished_spans()
    hops = {s.attributes["kvferry.actor"]: s for s in spans if s.name == "handle message"}
    request = next(s for s in spans if s.name == "request")
    front_work = next(s for s in spans if s.name == "front work")
    assert hops["front"].parent.span_id == request.context.span_id
    assert hops["front"].attributes["kvferry.message"] == "Go"
    assert hops["back"].parent.span_id == front_work.context.span_id
    assert {s.context.trace_id for s in spans} == {request.context.trace_id}


async def test_log_context_follows_a_request_from_actor_to_actor(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="tests.actors")
    provider, _ = recorded_spans()
    tracer = provider.get_tracer("tests")
    async with ActorSystem() as system:
        back_actor = Back(tracer)
        back = await system.spawn(back_actor, name="back")
        front = await system.spawn(Front(back, tracer), name="front")
        tokens = structlog.contextvars.bind_contextvars(req_id="req-7")
        try:
            await front.tell(Go())
        finally:
            structlog.contextvars.reset_contextvars(**tokens)
        await back_actor.done.wait()
    lines = {r.kvferry_event: r.kvferry for r in caplog.records if r.name == "tests.actors"}  # type: ignore[attr-defined]
    assert lines["front_handled"] == {"actor": "front", "message": "Go", "req_id": "req-7"}
    assert lines["back_handled"] == {"actor": "back", "message": "Work", "req_id": "req-7"}


@pytest.mark.parametrize("kind", ["stepped", "thread"])
def test_a_sync_call_runs_in_the_callers_span(kind: str) -> None:
    provider, exporter = recorded_spans()
    tracer = provider.get_tracer("tests")

    async def setup(system: ActorSystem) -> ActorRef[Work]:
        return await system.spawn(Back(tracer))

    runtime, back = start_runtime(kind, setup)
    try:
        with tracer.start_as_current_span("engine step"):
            runtime.call(back.ask, lambda r: Work(reply=r))
    finally:
        runtime.close()
    spans = by_name(exporter)
    assert spans["back work"].parent.span_id == spans["engine step"].context.span_id
