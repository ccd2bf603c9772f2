"""Worker-side transfers: KV layouts, the host pool, copy engines, the completion bridge,
one actor per direction, and raw block access."""

from __future__ import annotations

from ._access import KVBlockAccess as KVBlockAccess
from ._actors import Flushed as Flushed
from ._actors import FlushJobs as FlushJobs
from ._actors import GetStatistics as GetStatistics
from ._actors import JobFailed as JobFailed
from ._actors import JobResult as JobResult
from ._actors import LoadActor as LoadActor
from ._actors import PollFinished as PollFinished
from ._actors import StoreActor as StoreActor
from ._actors import SubmitJob as SubmitJob
from ._actors import SubmitJobs as SubmitJobs
from ._actors import TransferActor as TransferActor
from ._actors import TransferMsg as TransferMsg
from ._actors import TransferStatistics as TransferStatistics
from ._completion import CompletionBridge as CompletionBridge
from ._copy import Cancellable as Cancellable
from ._copy import Completion as Completion
from ._copy import CopyEngine as CopyEngine
from ._copy import CopyJob as CopyJob
from ._copy import DeviceFenced as DeviceFenced
from ._copy import Direction as Direction
from ._copy import EndedCompletion as EndedCompletion
from ._copy import FutureCompletion as FutureCompletion
from ._copy import GroupBlocks as GroupBlocks
from ._copy import JobCancelled as JobCancelled
from ._copy import capture_compute as capture_compute
from ._copy import copy_job as copy_job
from ._copy import new_copy_engine as new_copy_engine
from ._copy import submit_batch as submit_batch
from ._cuda import ComputeMark as ComputeMark
from ._cuda import CudaCopyEngine as CudaCopyEngine
from ._cuda import CudaEngineStatistics as CudaEngineStatistics
from ._layout import GroupLayout as GroupLayout
from ._layout import KVLayout as KVLayout
from ._layout import Region as Region
from ._layout import Segment as Segment
from ._layout import describe_kv_caches as describe_kv_caches
from ._layout import layer_segments as layer_segments
from ._pool import HostPool as HostPool
from ._threads import ThreadCopyEngine as ThreadCopyEngine

__all__ = [
    "Cancellable",
    "Completion",
    "CompletionBridge",
    "ComputeMark",
    "CopyEngine",
    "CopyJob",
    "CudaCopyEngine",
    "CudaEngineStatistics",
    "DeviceFenced",
    "Direction",
    "EndedCompletion",
    "FlushJobs",
    "Flushed",
    "FutureCompletion",
    "GetStatistics",
    "GroupBlocks",
    "GroupLayout",
    "HostPool",
    "JobCancelled",
    "JobFailed",
    "JobResult",
    "KVBlockAccess",
    "KVLayout",
    "LoadActor",
    "PollFinished",
    "Region",
    "Segment",
    "StoreActor",
    "SubmitJob",
    "SubmitJobs",
    "ThreadCopyEngine",
    "TransferActor",
    "TransferMsg",
    "TransferStatistics",
    "capture_compute",
    "copy_job",
    "describe_kv_caches",
    "layer_segments",
    "new_copy_engine",
    "submit_batch",
]
