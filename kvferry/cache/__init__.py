"""Scheduler-side bookkeeping of the host tier: the block directory, eviction policies
(LRU, ARC, S3-FIFO, or your own), admission, and KV events."""

from __future__ import annotations

from ._actor import DirectoryActor as DirectoryActor
from ._actor import EvictorActor as EvictorActor
from ._actor import HostTier as HostTier
from ._actor import PublisherActor as PublisherActor
from ._actor import spawn_host_tier as spawn_host_tier
from ._admission import DEFAULT_WATERMARKS as DEFAULT_WATERMARKS
from ._admission import AdmissionFilter as AdmissionFilter
from ._admission import check_store_threshold as check_store_threshold
from ._admission import check_watermarks as check_watermarks
from ._arc import ARCPolicy as ARCPolicy
from ._directory import Directory as Directory
from ._directory import Key as Key
from ._events import AllBlocksCleared as AllBlocksCleared
from ._events import BlockInfo as BlockInfo
from ._events import BlocksRemoved as BlocksRemoved
from ._events import BlocksStored as BlocksStored
from ._events import EventBuffer as EventBuffer
from ._events import KVEvent as KVEvent
from ._events import replay as replay
from ._events import to_vllm_events as to_vllm_events
from ._messages import AttachEvictor as AttachEvictor
from ._messages import ClearAll as ClearAll
from ._messages import CompleteLoad as CompleteLoad
from ._messages import CompleteStore as CompleteStore
from ._messages import Demotions as Demotions
from ._messages import DirectoryMsg as DirectoryMsg
from ._messages import Drain as Drain
from ._messages import EndDemotions as EndDemotions
from ._messages import EvictorMsg as EvictorMsg
from ._messages import EvictSome as EvictSome
from ._messages import Fact as Fact
from ._messages import Facts as Facts
from ._messages import GetStatistics as GetStatistics
from ._messages import Lease as Lease
from ._messages import LoadLeased as LoadLeased
from ._messages import Lookup as Lookup
from ._messages import LookupAndPin as LookupAndPin
from ._messages import LookupEach as LookupEach
from ._messages import PrepareLoad as PrepareLoad
from ._messages import PrepareStore as PrepareStore
from ._messages import Publish as Publish
from ._messages import PublisherMsg as PublisherMsg
from ._messages import ResetCache as ResetCache
from ._messages import RoomLow as RoomLow
from ._messages import TakeDemotions as TakeDemotions
from ._messages import TakeEvents as TakeEvents
from ._messages import Touch as Touch
from ._messages import Unpin as Unpin
from ._policy import EvictionPolicy as EvictionPolicy
from ._policy import LRUPolicy as LRUPolicy
from ._policy import make_policy as make_policy
from ._s3fifo import S3FIFOPolicy as S3FIFOPolicy
from ._statistics import DirectoryStatistics as DirectoryStatistics

__all__ = [
    "DEFAULT_WATERMARKS",
    "ARCPolicy",
    "AdmissionFilter",
    "AllBlocksCleared",
    "AttachEvictor",
    "BlockInfo",
    "BlocksRemoved",
    "BlocksStored",
    "ClearAll",
    "CompleteLoad",
    "CompleteStore",
    "Directory",
    "DirectoryActor",
    "DirectoryMsg",
    "DirectoryStatistics",
    "Demotions",
    "Drain",
    "EndDemotions",
    "EventBuffer",
    "EvictSome",
    "Fact",
    "Facts",
    "EvictionPolicy",
    "EvictorActor",
    "EvictorMsg",
    "GetStatistics",
    "HostTier",
    "KVEvent",
    "Key",
    "LRUPolicy",
    "Lease",
    "LoadLeased",
    "Lookup",
    "LookupAndPin",
    "LookupEach",
    "PrepareLoad",
    "PrepareStore",
    "Publish",
    "PublisherActor",
    "PublisherMsg",
    "ResetCache",
    "RoomLow",
    "S3FIFOPolicy",
    "TakeDemotions",
    "TakeEvents",
    "Touch",
    "Unpin",
    "check_store_threshold",
    "check_watermarks",
    "make_policy",
    "replay",
    "spawn_host_tier",
    "to_vllm_events",
]
