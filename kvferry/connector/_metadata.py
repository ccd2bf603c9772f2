"""What crosses the process boundary each engine step: plain, picklable data.

Scheduler → workers: :class:`KVFerryMetadata` (this step's load and store jobs, the
stores to wait for before blocks are reused, the requests whose blocks are released once
their stores end). Workers → scheduler: :class:`KVFerryWorkerMetadata` (acknowledged jobs),
merged across workers by ``aggregate``.
"""

from __future__ import annotations

import attrs
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from ..transfer import CopyJob


@attrs.define(kw_only=True)
class JobSpec:
    """One transfer job for every worker: the copy, and the request it serves."""

    req_id: str
    copy: CopyJob
    traceparent: str | None = None


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

    def is_empty(self) -> bool:
        return not (
            self.loads
            or self.stores
            or self.flush_job_ids
            or self.release_req_ids
            or self.failed_load_job_ids
        )


@attrs.define(kw_only=True)
class KVFerryWorkerMetadata(KVConnectorWorkerMetadata):
    acks: dict[int, list[int]] = attrs.field(factory=dict)
    """job id → [workers that finished it, workers on which it failed]."""
    stats: dict[str, float] = attrs.field(factory=dict)
    """Transfer counters of this step (bytes and seconds per direction)."""

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
        return KVFerryWorkerMetadata(acks=acks, stats=stats)
