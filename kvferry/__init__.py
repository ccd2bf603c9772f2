"""kvferry: moves the KV cache of LLM inference between device memory and host memory.

The vLLM connector lives in :mod:`kvferry.connector` (imported only when vLLM is used).
"""

from __future__ import annotations

from ._config import FerryConfig as FerryConfig
from ._errors import ActorCrashed as ActorCrashed
from ._errors import ActorStopped as ActorStopped
from ._errors import ConfigError as ConfigError
from ._errors import HostMemoryError as HostMemoryError
from ._errors import InvariantError as InvariantError
from ._errors import KVFerryError as KVFerryError
from ._errors import TransferError as TransferError
from ._ferry import Ferry as Ferry

__version__ = "0.1.0"

__all__ = [
    "ActorCrashed",
    "ActorStopped",
    "ConfigError",
    "Ferry",
    "FerryConfig",
    "HostMemoryError",
    "InvariantError",
    "KVFerryError",
    "TransferError",
    "__version__",
]
