"""What crosses the process boundary each engine step: plain, picklable data.

Scheduler → workers: :class:`KVFerryMetadata` (this step's load and store jobs, the
stores to wait for before blocks are reused, the requests whose blocks are released once
their stores end, the disk tier's writes and deletes). Workers → scheduler:
:class:`KVFerryWorkerMetadata` (acknowledged jobs, per-chunk disk outcomes), merged across
workers by ``aggregate``.
"""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from ..transfer import CopyJob

KEPT = 1 << 16
"""In ``disk_failed``, what a worker reports for a chunk of a disk read that failed with
its file kept (a transient error, EMFILE or ENOMEM; a job aborted): the load fails, the
chunk stays. A chunk that failed and is gone on that worker (corrupt, absent, another
fingerprint's, deleted for an error that says the file is bad) counts 1, as any failed
write does. Summed over the workers, ``n % KEPT`` is on how many it is gone, ``n //
KEPT`` on how many it failed and stays (world sizes are far below ``KEPT``): one int per
chunk whatever the workers said, and ``n == 0`` still means "good everywhere"."""


@attrs.define(kw_only=True)
class DiskChunks:
    """Chunks between host slots and the disk tier: ``keys[i]`` <-> host slot ``slots[i]``
    (a slot holds one offloaded block of one KV-cache group)."""

    keys: list[bytes]
    slots: npt.NDArray[np.int64]


@attrs.define(kw_only=True)
class JobSpec:
    """One transfer job for every worker: the copy, and the request it serves."""

    req_id: str
    copy: CopyJob
    traceparent: str | None = None
    disk_reads: DiskChunks | None = None
    """A load only: read these chunks from the disk tier into their host slots (reserved
    for it) first; the copy starts once all are read and verified. Any that fails fails
    the load on that worker (its blocks are recomputed)."""
    redis_reads: DiskChunks | None = None
    """A load only: the same for chunks read from the Redis tier (after the disk's)."""


@attrs.define(kw_only=True)
class DiskWriteSpec:
    """Write host slots down to a lower tier (slots pinned until every worker acked)."""

    job_id: int
    chunks: DiskChunks


@attrs.define(kw_only=True)
class KVFerryMetadata(KVConnectorMetadata):
    loads: list[JobSpec] = attrs.field(factory=list)
    stores: list[JobSpec] = attrs.field(factory=list)
    flush_job_ids: list[int] = attrs.field(factory=list)
    """Stores that must end before this step's forward (their blocks are being reused)."""
    release_req_ids: list[str] = attrs.field(factory=list)
    """Finished requests whose blocks vLLM keeps until their stores end (finished_sending)."""
    failed_load_job_ids: list[int] = attrs.field(factory=list)
    """Loads the scheduler ended as failed at their deadline: whenever the copy ends, its
    engine blocks are reported invalid (their host slots may have been reused since)."""
    disk_writes: list[DiskWriteSpec] = attrs.field(factory=list)
    """Disk-tier writes, queued after this step's stores (``wait_for_save``)."""
    disk_deletes: list[bytes] = attrs.field(factory=list)
    """Keys the disk tier evicted (or found on some workers only): files to delete, before
    this step's disk writes (a key may be written again later)."""
    redis_writes: list[DiskWriteSpec] = attrs.field(factory=list)
    """Redis-tier writes, queued after this step's stores."""

    def is_empty(self) -> bool:
        return not (
            self.loads
            or self.stores
            or self.flush_job_ids
            or self.release_req_ids
            or self.failed_load_job_ids
            or self.disk_writes
            or self.disk_deletes
            or self.redis_writes
        )


@attrs.define(kw_only=True)
class KVFerryWorkerMetadata(KVConnectorWorkerMetadata):
    acks: dict[int, list[int]] = attrs.field(factory=dict)
    """job id → [workers that finished it, workers on which it failed]."""
    stats: dict[str, float] = attrs.field(factory=dict)
    """Transfer counters of this step (bytes and seconds per direction, disk I/O)."""
    disk_failed: dict[int, list[int]] = attrs.field(factory=dict)
    """job id -> per chunk of its disk reads (a load) or writes (a disk write), on how many
    workers that chunk failed; reported with the job's ack (0 everywhere: all good). A
    read's chunk that failed with its file kept counts :data:`KEPT` instead of 1."""
    redis_failed: dict[int, list[int]] = attrs.field(factory=dict)
    """The same for the Redis tier's reads and writes (a failure counts 1: no
    :data:`KEPT`)."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVFerryWorkerMetadata):
            raise TypeError(
                f"kvferry's worker metadata merged with a {type(other).__name__} "
                "(another connector's?)"
            )
        acks = {k: list(v) for k, v in self.acks.items()}
        for job_id, (done, failed) in other.acks.items():
            mine = acks.setdefault(job_id, [0, 0])
            mine[0] += done
            mine[1] += failed
        stats = dict(self.stats)
        for k, v in other.stats.items():
            stats[k] = stats.get(k, 0.0) + v
        return KVFerryWorkerMetadata(
            acks=acks,
            stats=stats,
            disk_failed=_sum_counts(self.disk_failed, other.disk_failed),
            redis_failed=_sum_counts(self.redis_failed, other.redis_failed),
        )


def _sum_counts(mine: dict[int, list[int]], other: dict[int, list[int]]) -> dict[int, list[int]]:
    """Per-chunk failure counts of two workers, job by job."""
    out = {k: list(v) for k, v in mine.items()}
    for job_id, counts in other.items():
        have = out.get(job_id)
        if have is None:
            out[job_id] = list(counts)
        else:
            out[job_id] = [a + b for a, b in zip(have, counts, strict=True)]
    return out
