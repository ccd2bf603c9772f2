"""structlog routed into the standard :mod:`logging` module.

The library never configures logging: inside vLLM every line lands in vLLM's own log
handlers. Loggers are bound per actor and per message, never at module scope.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog
from structlog.typing import EventDict, WrappedLogger


def _to_stdlib(_: WrappedLogger, __: str, event_dict: EventDict) -> dict[str, Any]:
    event = event_dict.pop("event")
    exc_info = event_dict.pop("exc_info", None)
    ctx = " ".join(f"{k}={v!r}" for k, v in sorted(event_dict.items()))
    return {
        "msg": f"{event} {ctx}" if ctx else event,
        "exc_info": exc_info,
        "extra": {"kvferry": dict(event_dict), "kvferry_event": event},
    }


_PROCESSORS: list[Any] = [
    structlog.stdlib.filter_by_level,
    structlog.contextvars.merge_contextvars,
    _to_stdlib,
]


def get_logger(name: str, **bound: Any) -> Any:
    """A structlog logger writing through ``logging.getLogger(name)``."""
    log = structlog.wrap_logger(
        logging.getLogger(name),
        processors=_PROCESSORS,
        wrapper_class=structlog.stdlib.BoundLogger,
    )
    return log.bind(**bound) if bound else log
