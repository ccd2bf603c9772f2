"""Ferry: kvferry embedded in your own async serving loop, on your own event loop.

::

    async with kvferry.Ferry(kv_caches, num_blocks=N, cpu_bytes_to_use=2 << 30) as ferry:
        hit = await ferry.lookup(keys)                  # leading keys stored and ready
        await ferry.load(keys[:hit], block_ids[:hit])   # host → your engine's blocks
        ...                                             # compute the rest
        await ferry.store(keys, block_ids)              # your engine's blocks → host

It runs the same actors as the vLLM connector, in an :class:`~kvferry.actors.ActorSystem`
on the caller's loop (asyncio or trio): a :class:`~kvferry.cache.DirectoryActor` owns the
bookkeeping (which key lives in which host slot), a :class:`~kvferry.transfer.StoreActor`
and a :class:`~kvferry.transfer.LoadActor` run the copies on the copy engine (copy
threads on the CPU, CUDA streams on a GPU). One key names one engine block.

Waiting for a copy never blocks the loop: the copy runs on a copy thread (or CUDA
streams), a watcher thread waits for its completion, and the caller is woken when that
thread returns; concurrent stores and loads keep the copy engine busy in parallel.

Who owns what: the Ferry owns the host pool and the copy engine; the actors own the
directory and the jobs in flight. Every method must be called on the loop that entered
the ``async with``; several tasks may call them at once.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt
import torch
from opentelemetry import trace

from ._config import _finite
from ._errors import ActorStopped, TransferError
from ._logging import get_logger
from .actors import ActorRef, ActorSystem, Reply
from .cache import (
    CompleteLoad,
    CompleteStore,
    DirectoryActor,
    DirectoryMsg,
    DirectoryStatistics,
    Lookup,
    PrepareLoad,
    PrepareStore,
)
from .cache import GetStatistics as GetDirectoryStatistics
from .transfer import (
    CopyEngine,
    CopyJob,
    GroupBlocks,
    HostPool,
    JobResult,
    KVLayout,
    LoadActor,
    StoreActor,
    SubmitJob,
    TransferMsg,
    capture_compute,
    describe_kv_caches,
    new_copy_engine,
)

Key = bytes


class Ferry:
    """The host tier of your engine's KV cache: an async context manager.

    ``kv_caches`` maps layer names to the engine's KV tensors (or is a list of them); each
    has one dimension of ``num_blocks`` entries, the block dimension (vLLM's layouts, or
    your own). ``cpu_bytes_to_use`` sizes the host pool, allocated on entry.
    ``block_stride_bytes`` picks the block dimension if several have ``num_blocks``
    entries. A copy past ``job_timeout_s`` is cancelled where the engine can cancel it,
    and fails (it and ``stop_timeout_s`` are finite numbers, > 0 and >= 0, else a
    :class:`ValueError`). ``copy_threads`` sizes the CPU copy engine (a whole number >= 1, else a
    :class:`ValueError`; None: one per core, two to four); ``copy_engine(layout, pool)``
    replaces it (tests inject failures this way). ``tracer_provider`` traces every actor
    hop (``handle message`` spans).
    """

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
        *,
        num_blocks: int,
        cpu_bytes_to_use: int,
        block_stride_bytes: int | None = None,
        job_timeout_s: float = 60.0,
        copy_threads: int | None = None,
        copy_engine: Callable[[KVLayout, HostPool], CopyEngine] | None = None,
        stop_timeout_s: float = 10.0,
        tracer_provider: trace.TracerProvider | None = None,
    ) -> None:
        # Refused here, not when the engine starts: with no copy thread, the first store
        # would wait forever (its wait is shielded from cancellation).
        if copy_threads is not None and (
            isinstance(copy_threads, bool) or not isinstance(copy_threads, int) or copy_threads < 1
        ):
            raise ValueError(
                "copy_threads must be a whole number >= 1 (None: the default), "
                f"got {copy_threads!r}"
            )
        # A deadline that is not a finite number fails every job at once (<= 0), never
        # (NaN), or crashes the copy actor on every job (a string); a stop timeout of NaN
        # fails the exit.
        job_timeout = _finite(job_timeout_s)
        if job_timeout is None or job_timeout <= 0:
            raise ValueError(f"job_timeout_s must be a finite number > 0, got {job_timeout_s!r}")
        stop_timeout = _finite(stop_timeout_s)
        if stop_timeout is None or stop_timeout < 0:
            raise ValueError(f"stop_timeout_s must be a finite number >= 0, got {stop_timeout_s!r}")
        if not isinstance(kv_caches, Mapping):
            kv_caches = {f"layer.{i}": t for i, t in enumerate(kv_caches)}
        self.layout: KVLayout = describe_kv_caches(
            kv_caches, [list(kv_caches)], num_blocks, block_stride_bytes
        )
        self.num_blocks = num_blocks
        self.num_slots = cpu_bytes_to_use // self.layout.row_bytes
        self._cpu_bytes = cpu_bytes_to_use
        self._job_timeout_s = job_timeout_s
        self._copy_threads = copy_threads
        self._copy_engine = copy_engine
        self._system = ActorSystem(stop_timeout_s=stop_timeout_s, tracer_provider=tracer_provider)
        self._job_ids = itertools.count(1)
        self._waiting: set[Reply[JobResult]] = set()
        """The notify replies of the stores and loads waiting (failed at exit if unanswered)."""
        self._pool: HostPool | None = None
        self._engine: CopyEngine | None = None
        self._directory: ActorRef[DirectoryMsg] | None = None
        self._store: ActorRef[TransferMsg] | None = None
        self._load: ActorRef[TransferMsg] | None = None
        self._log = get_logger("kvferry.ferry")

    @property
    def system(self) -> ActorSystem:
        """The actor system (for ``statistics()`` of every actor)."""
        return self._system

    async def __aenter__(self) -> Ferry:
        """Allocate the host pool (:class:`~kvferry.HostMemoryError` if the machine can't
        give it), start the copy engine and the actors."""
        layout = self.layout
        self._pool = HostPool(self.num_slots, 1, layout.row_bytes, pin=layout.device.type == "cuda")
        if self._copy_engine is not None:
            self._engine = self._copy_engine(layout, self._pool)
        else:
            self._engine = new_copy_engine(layout, self._pool, num_threads=self._copy_threads)
        await self._system.__aenter__()
        try:
            self._directory = await self._system.spawn(
                DirectoryActor(self.num_slots), name="directory"
            )
            timeout = self._job_timeout_s
            self._load = await self._system.spawn(LoadActor(self._engine, job_timeout_s=timeout))
            self._store = await self._system.spawn(StoreActor(self._engine, job_timeout_s=timeout))
        except BaseException as exc:
            await self.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        self._log.info("ferry_started", num_slots=self.num_slots, host_pool_bytes=self._pool.nbytes)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop the actors (store, load, directory), then the copy engine."""
        try:
            await self._system.__aexit__(exc_type, exc, tb)
        finally:
            engine, self._engine = self._engine, None
            if engine is not None:
                # Joins the copy threads, on the loop: they are idle by now (a store or
                # load returns only once its copy ended, cancelled or not), so this is
                # quick, and it starts no worker thread that would outlive the Ferry.
                engine.close()
            # An actor cancelled at the stop deadline answered none of its jobs: their
            # (shielded) waits end now, once nothing copies any more.
            for notify in list(self._waiting):
                if not notify.done:
                    notify.fail(ActorStopped("the Ferry stopped before the job ended"))
            pool, self._pool = self._pool, None
            if pool is not None:
                pool.close()

    def _refs(self) -> tuple[ActorRef[DirectoryMsg], ActorRef[TransferMsg], ActorRef[TransferMsg]]:
        if self._directory is None or self._store is None or self._load is None:
            raise RuntimeError("use the Ferry inside `async with`")
        return self._directory, self._store, self._load

    def _blocks(self, keys: Sequence[Key], block_ids: npt.ArrayLike) -> npt.NDArray[np.int64]:
        blocks = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if len(blocks) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(blocks)} block ids")
        if len(blocks) and (blocks.min() < 0 or blocks.max() >= self.num_blocks):
            raise ValueError(f"block ids must be in 0..{self.num_blocks - 1}")
        return blocks

    async def lookup(self, keys: Sequence[Key]) -> int:
        """How many leading ``keys`` are stored and ready to load."""
        directory, _, _ = self._refs()
        return await directory.ask(lambda r: Lookup(keys=tuple(keys), reply=r))

    async def store(self, keys: Sequence[Key], block_ids: npt.ArrayLike) -> int:
        """Copy engine block ``block_ids[i]`` to host memory under ``keys[i]``, and return
        how many blocks were copied: keys already stored, and keys the host tier had no
        room for (every slot pinned or being written), are skipped.

        Returns once the copies have ended and the keys are visible to :meth:`lookup`.
        The engine may overwrite the blocks after that. Raises
        :class:`~kvferry.TransferError` if the copy failed (no key becomes visible).
        Cancellation waits for the copy to end: host slots are never left half-written.
        """
        blocks = self._blocks(keys, block_ids)
        directory, store, _ = self._refs()
        if not len(blocks):
            return 0
        with anyio.CancelScope(shield=True):
            slots: npt.NDArray[np.int64] = await directory.ask(
                lambda r: PrepareStore(keys=tuple(keys), reply=r)
            )
            taken = slots >= 0
            if not taken.any():
                return 0
            live = slots[taken]
            result = await self._run(store, "store", blocks[taken], live)
            await directory.tell(CompleteStore(slots=live, ok=result.ok))
        if not result.ok:
            raise TransferError(f"store of {len(live)} blocks failed: {result.error}")
        return len(live)

    async def load(self, keys: Sequence[Key], block_ids: npt.ArrayLike) -> None:
        """Copy the host copies of ``keys`` into engine blocks ``block_ids`` (``keys[i]`` →
        ``block_ids[i]``), returning once the copies have ended.

        Every key must be stored and ready (:meth:`lookup` first): otherwise
        :class:`KeyError`, and nothing is copied. Raises :class:`~kvferry.TransferError`
        if the copy failed; those blocks then hold nothing valid (recompute them).
        Cancellation waits for the copy to end: a block is never written after it.
        """
        blocks = self._blocks(keys, block_ids)
        directory, _, load = self._refs()
        if not len(blocks):
            return
        with anyio.CancelScope(shield=True):
            found: npt.NDArray[np.int64] | None = await directory.ask(
                lambda r: PrepareLoad(keys=tuple(keys), reply=r)
            )
            if found is None:
                raise KeyError("a key to load is not stored (evicted since the lookup?)")
            slots = found
            try:
                result = await self._run(load, "load", blocks, slots)
            finally:
                try:
                    await directory.tell(CompleteLoad(slots=slots))  # unpin
                except ActorStopped:
                    # The Ferry is stopping and its directory has stopped: no pin outlives
                    # it, and the load's own outcome (its copy ended) still stands.
                    pass
        if not result.ok:
            raise TransferError(f"load of {len(slots)} blocks failed: {result.error}")

    async def statistics(self) -> DirectoryStatistics:
        """The host tier's counters (capacity, hits, stores, evictions...)."""
        directory, _, _ = self._refs()
        return await directory.ask(lambda r: GetDirectoryStatistics(reply=r))

    async def _run(
        self,
        ref: ActorRef[TransferMsg],
        direction: Any,
        blocks: npt.NDArray[np.int64],
        rows: npt.NDArray[np.int64],
    ) -> JobResult:
        """Submit one copy job and wait for its result: the actor answers ``notify``
        when a watcher thread sees the job's completion end (no polling), or fails it
        past the job's deadline; :class:`~kvferry.ActorStopped` if the actor stopped
        first (its ``on_stop``, or, for an actor cancelled at the stop deadline, the
        Ferry's exit: this wait is shielded, it must not last forever)."""
        job = CopyJob(
            job_id=next(self._job_ids),
            direction=direction,
            parts=(GroupBlocks(group=0, device_blocks=blocks, host_rows=rows),),
            timeout_s=self._job_timeout_s,
        )
        if self._engine is None:
            raise RuntimeError("use the Ferry inside `async with`")
        notify: Reply[JobResult] = Reply()
        # Ordered after the caller's compute stream (on CUDA), captured on this thread.
        mark = capture_compute(self._engine)
        await ref.tell(SubmitJob(job=job, compute=mark, notify=notify))
        self._waiting.add(notify)
        try:
            return await notify.wait()
        finally:
            self._waiting.discard(notify)
