"""Graceful shutdown: dependency order, a deadline, and nothing left behind."""

from __future__ import annotations

import anyio
import anyio.to_thread
import attrs
import pytest

from kvferry.actors import (
    Actor,
    ActorRef,
    ActorStopped,
    ActorSystem,
    Reply,
    ShutdownReport,
    start_runtime,
)
from kvferry.actors._testing import (
    assert_no_task_left,
    assert_no_thread_left,
    settle,
    virtual_time_backend,
)

from ._actors import Block, Counter, Get, Msg, block

pytestmark = pytest.mark.anyio


@attrs.frozen(kw_only=True)
class Note:
    text: str


@attrs.frozen(kw_only=True)
class InThread:
    """Answered from a worker thread (anyio.to_thread): the runtime must stop it too."""

    reply: Reply[int] = attrs.field(eq=False, repr=False)


class Journal(Actor[Note]):
    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def handle(self, msg: Note) -> None:
        self.log.append(msg.text)

    async def on_stop(self) -> None:
        self.log.append("journal stopped")


class Writer(Actor[InThread]):
    """Depends on the journal: it writes to it while it stops."""

    def __init__(self, journal: ActorRef[Note], log: list[str]) -> None:
        self.journal = journal
        self.log = log

    async def handle(self, msg: InThread) -> None:
        msg.reply.set(await anyio.to_thread.run_sync(lambda: 41 + 1))

    async def on_stop(self) -> None:
        await self.journal.tell(Note(text="writer says goodbye"))
        self.log.append("writer stopped")


async def spawn_pair(system: ActorSystem, log: list[str]) -> ActorRef[InThread]:
    journal = await system.spawn(Journal(log), name="journal")
    writer = await system.spawn(Writer(journal, log), name="writer")
    system.send_every(3600.0, journal, Note(text="hourly"))  # a timer is running too
    return writer


async def test_actors_stop_last_spawned_first_while_their_dependencies_still_answer() -> None:
    log: list[str] = []
    async with ActorSystem() as system:
        await spawn_pair(system, log)
    assert log == ["writer stopped", "writer says goodbye", "journal stopped"]
    assert system.shutdown_report == ShutdownReport()


@pytest.mark.parametrize("anyio_backend", [virtual_time_backend()])
async def test_an_actor_busy_past_the_deadline_is_cancelled_and_its_asks_fail() -> None:
    errors: list[BaseException] = []
    async with anyio.create_task_group() as tg:
        async with ActorSystem(stop_timeout_s=5.0) as system:
            stuck = await system.spawn(Counter(), name="stuck")
            await block(stuck, anyio.Event())  # never set

            async def asker() -> None:
                try:
                    await stuck.ask(Get)
                except ActorStopped as exc:
                    errors.append(exc)

            tg.start_soon(asker)
            await settle()
            t0 = anyio.current_time()
        assert anyio.current_time() - t0 == pytest.approx(5.0)
    assert len(errors) == 1
    assert system.shutdown_report == ShutdownReport(timed_out=("stuck",))


async def test_a_stopped_system_refuses_new_actors_and_timers() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Counter())
    with pytest.raises(RuntimeError, match="not running"):
        await system.spawn(Counter())
    with pytest.raises(RuntimeError, match="not running"):
        system.send_after(1.0, ref, Get)


async def test_on_a_running_loop_no_task_or_thread_is_left_behind() -> None:
    log: list[str] = []
    with assert_no_thread_left():
        async with assert_no_task_left():
            async with ActorSystem() as system:
                await spawn_pair(system, log)
                await system.spawn(Counter(), name="counter")
    assert log[-1] == "journal stopped"


@pytest.mark.parametrize("kind", ["stepped", "thread"])
def test_a_sync_runtime_leaves_no_task_or_thread_behind(kind: str) -> None:
    log: list[str] = []

    async def setup(system: ActorSystem) -> ActorRef[InThread]:
        return await spawn_pair(system, log)

    with assert_no_thread_left():
        runtime, writer = start_runtime(kind, setup)
        assert runtime.call(writer.ask, InThread) == 42  # starts an anyio worker thread
        report = runtime.close()
    assert report == ShutdownReport() and report.clean
    assert log == ["writer stopped", "writer says goodbye", "journal stopped"]
    assert runtime.close() is report  # idempotent


class SlowStart(Counter):
    """A counter whose ``on_start`` waits for ``gate``."""

    def __init__(self, gate: anyio.Event) -> None:
        super().__init__()
        self.gate = gate

    async def on_start(self) -> None:
        await self.gate.wait()


async def test_an_actor_starting_when_the_system_begins_to_stop_is_stopped_too() -> None:
    gate = anyio.Event()
    refs: list[ActorRef[Msg]] = []
    with anyio.fail_after(5.0):  # the defect is a hang on leaving the system
        async with ActorSystem() as system, anyio.create_task_group() as tg:
            first = await system.spawn(Counter(), name="first")

            async def spawn_slow() -> None:
                refs.append(await system.spawn(SlowStart(gate), name="slow"))

            tg.start_soon(spawn_slow)
            await settle()  # "slow" waits in on_start
            tg.start_soon(system.stop_all)
            await settle()
            # Stopping waits for the actor spawned last, still starting, before "first".
            assert first.statistics().running and not system.statistics()[1].running
            gate.set()
            report = await system.wait_stopped()
        assert report == ShutdownReport()
        [slow] = refs
        assert not slow.statistics().running
        with pytest.raises(ActorStopped):
            await slow.ask(Get)


@pytest.mark.parametrize("anyio_backend", [virtual_time_backend()])
async def test_an_actor_still_starting_at_the_stop_deadline_is_cancelled() -> None:
    errors: list[BaseException] = []
    with anyio.fail_after(60.0):
        async with ActorSystem(stop_timeout_s=5.0) as system, anyio.create_task_group() as tg:

            async def spawn_slow() -> None:
                try:
                    await system.spawn(SlowStart(anyio.Event()), name="slow")  # never set
                except ActorStopped as exc:
                    errors.append(exc)

            tg.start_soon(spawn_slow)
            await settle()
            t0 = anyio.current_time()
            report = await system.stop_all()
            assert anyio.current_time() - t0 == pytest.approx(5.0)
    assert report == ShutdownReport(timed_out=("slow",))
    assert len(errors) == 1 and system.statistics() == ()


@attrs.frozen(kw_only=True)
class Submit:
    """A tell whose answer slot is not named ``reply`` (as the transfer's ``notify``)."""

    notify: Reply[int] = attrs.field(eq=False, repr=False)


class Submitter(Actor[Submit | Block]):
    mailbox_size = 4

    async def handle(self, msg: Submit | Block) -> None:
        match msg:
            case Block(gate=gate, entered=entered):
                if entered is not None:
                    entered.set()
                await gate.wait()
            case Submit(notify=notify):
                notify.set(1)


async def test_a_queued_tells_answer_slot_of_any_name_fails_when_the_actor_stops() -> None:
    notify: Reply[int] = Reply()
    async with ActorSystem() as system:
        ref = await system.spawn(Submitter(), name="submitter")
        await block(ref, anyio.Event())  # never set
        await ref.tell(Submit(notify=notify))
        await ref.stop(drain=False)
        with anyio.fail_after(5.0):  # the defect: its waiter waits forever
            with pytest.raises(ActorStopped, match="before answering Submit"):
                await notify.wait()
    assert ref.statistics().messages_dropped == 0
