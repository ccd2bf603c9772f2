"""The scheduler half's state of each request and each job in flight.

Who owns what: :class:`~kvferry.connector._scheduler.SchedulerSide` creates and owns these
objects, on vLLM's engine thread (one :class:`ReqState` per request vLLM told it of, one
:class:`JobState` per load, store or disk write not yet acknowledged by every worker);
nothing here calls out. :func:`parse_request_params` reads a request's own options.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from vllm.v1.request import Request


def parse_request_params(params: Any) -> tuple[bool, bool, str | None]:
    """``kv_transfer_params={"kvferry": {"load": bool, "store": bool}}`` -> (load, store, error).

    A bad value is not fatal to the engine: it is logged, the defaults are kept, and the
    error is returned to the client in the request's ``kv_transfer_params``.
    """
    opts = (params or {}).get("kvferry") if isinstance(params, dict) else None
    if opts is None:
        return True, True, None
    if not isinstance(opts, dict):
        return True, True, f"kv_transfer_params['kvferry'] must be a dict, got {opts!r}"
    unknown = sorted(set(opts) - {"load", "store"})
    if unknown:
        return (
            True,
            True,
            f"kv_transfer_params['kvferry'][{unknown[0]!r}]: unknown key (known: load, store)",
        )
    for key in ("load", "store"):
        if key in opts and not isinstance(opts[key], bool):
            return (
                True,
                True,
                f"kv_transfer_params['kvferry'][{key!r}] must be true or false, got {opts[key]!r}",
            )
    return opts.get("load", True), opts.get("store", True), None


@attrs.define
class ReqState:
    """A request vLLM told the scheduler half of, from ``on_new_request`` until it finished
    and its jobs ended."""

    request: Request
    block_ids: list[list[int]]
    load: bool = True
    store: bool = True
    error: str | None = None
    stored_upto: int = 0
    """Chunks below this index were stored (or skipped, or loaded) already."""
    lookup: tuple[int, int] | None = None
    """(num_computed_tokens, hit chunks) of the last get_num_new_matched_tokens."""
    counts: tuple[int, int] | None = None
    """(tokens asked, tokens hit) of the last lookup, counted once the request is admitted."""
    disk_tokens: int = 0
    """Of the last lookup's hit, the tokens of chunks read from the disk tier."""
    redis_tokens: int = 0
    """Of the last lookup's hit, the tokens of chunks read from the Redis tier."""
    redis_wait_since: float | None = None
    """When this request's lookup first said "ask again" for a Redis existence check
    (``lookup_wait_ms`` runs from then); None once it went on."""
    load_job: int | None = None
    load_failed: bool = False
    """A load of this request failed: it loads nothing more (vLLM recomputes; a load that
    fails every time would otherwise be planned again at every retry, and the request
    never end)."""
    store_jobs: set[int] = attrs.field(factory=set)
    keys: list[bytes] = attrs.field(factory=list)
    """Offload keys of the request's chunks so far, all groups of a chunk together."""
    finished: bool = False
    tokens_loaded: int = 0


DiskLease = tuple[list[bytes], npt.NDArray[np.int64], npt.NDArray[np.int64], frozenset[bytes]]
"""(keys below host memory, their pins in the disk tier (those on disk), the host slots
reserved for them, those of the keys read from Redis instead)."""


@attrs.define
class JobState:
    """A load, store or disk write planned for the workers, until every worker reported it
    (or, a load, its deadline passed)."""

    job_id: int
    req_id: str
    is_store: bool
    slots: npt.NDArray[np.int64]
    tokens: int
    acks: int = 0
    failed: bool = False
    fenced: tuple[int, ...] = ()
    """Sliding-window blocks this store reads, which vLLM may free before it ends."""
    keys: tuple[bytes, ...] = ()
    """The keys a load fills (another request needing them waits for it); with a disk
    tier, the keys a store fills (written down once it ended)."""
    deadline: float = float("inf")
    """For a load: when, unacknowledged, it is ended as failed (``job_timeout_s``)."""
    disk_keys: tuple[bytes, ...] = ()
    """A load: the chunks read from disk first; a disk write: the chunks written."""
    disk_host_slots: npt.NDArray[np.int64] = attrs.field(factory=lambda: np.zeros(0, np.int64))
    """A load: the host slots reserved (STORING) for its disk chunks, READY once read."""
    disk_slots: npt.NDArray[np.int64] = attrs.field(factory=lambda: np.zeros(0, np.int64))
    """A load: its pins in the disk directory; a disk write: the places it fills."""
    disk_failed: npt.NDArray[np.int64] | None = None
    """Per disk chunk, on how many workers it failed (summed over the workers' reports)."""
    redis_keys: tuple[bytes, ...] = ()
    """A load: the chunks read from Redis first (after the disk's)."""
    redis_host_slots: npt.NDArray[np.int64] = attrs.field(factory=lambda: np.zeros(0, np.int64))
    """A load: the host slots reserved (STORING) for its Redis chunks, READY once read."""
    redis_failed: npt.NDArray[np.int64] | None = None
    """Per Redis chunk (read, or written), on how many workers it failed."""
    tier: str = "disk"
    """A write down: the tier written ("disk" or "redis")."""
    disk_write: bool = False
    demotion: bool = False
    """A disk write of blocks host memory evicted (``write: "on_evict"``): its host slots
    are DEMOTING, freed (not unpinned) when it ends."""
    unplanned: bool = False
    """A load the scheduler could not plan: planned failed, it copies nothing."""
    first_chunk: int | None = None
    """A planned load: the first chunk it fills. Failed, its request stores from there
    again once vLLM recomputed the blocks (a chunk that failed its read is nowhere now)."""
    event_keys: tuple[bytes, ...] = ()
    """A store's planned keys (a disk write's keys; a load's keys when it reads chunks
    from below host memory, which then enter host memory), retired from the block book
    (the complete KV events' facts) when it ends."""
