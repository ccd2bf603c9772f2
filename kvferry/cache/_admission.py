"""Admission to the host tier, and the checks of the tier's settings.

``store_threshold`` (vLLM's knob of the same name): a block is stored only at the N-th
time it is offered, so a block nobody asks for twice never costs a copy or evicts a block
that would have been reused. Offers are counted per key tag over the ``tracker_size``
distinct keys offered most recently (vLLM keeps the same LRU-bounded count), in numpy.

Who owns what: an :class:`AdmissionFilter` belongs to one directory.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .._errors import ConfigError
from ._table import I64, FingerprintQueue

DEFAULT_WATERMARKS = (0.97, 0.99)
"""(low, high) occupancy: above 99% full, the evictor brings the tier down to 97%."""


def check_watermarks(watermarks: tuple[float, float]) -> tuple[float, float]:
    """(low, high) as floats; :class:`~kvferry.ConfigError` (``eviction_watermarks``)
    unless ``0 < low <= high <= 1``."""
    try:
        low, high = (float(w) for w in watermarks)
    except (TypeError, ValueError):
        raise ConfigError(
            "eviction_watermarks", f"must be two numbers [low, high], got {watermarks!r}"
        ) from None
    if not (0.0 < low <= high <= 1.0):
        raise ConfigError("eviction_watermarks", f"need 0 < low <= high <= 1, got {[low, high]}")
    return low, high


def check_store_threshold(threshold: int) -> int:
    """:class:`~kvferry.ConfigError` (``store_threshold``) unless a whole number >= 1."""
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
        raise ConfigError("store_threshold", f"must be a whole number >= 1, got {threshold!r}")
    return threshold


class AdmissionFilter:
    """Admits a key at its ``threshold``-th offer; counts the refusals in ``skipped``."""

    def __init__(
        self, threshold: int, tracker_size: int = 64_000, *, compiled: bool | None = None
    ) -> None:
        self.threshold = check_store_threshold(threshold)
        if tracker_size < 1:
            raise ConfigError("store_threshold_tracker_size", f"must be >= 1, got {tracker_size}")
        self._counts = FingerprintQueue(tracker_size, payload=True, compiled=compiled)
        self.skipped = 0

    def offer(self, tags: I64) -> npt.NDArray[np.bool_]:
        """Count one offer of each (distinct) key; True where it reached the threshold."""
        idx = self._counts.find(tags)
        counts = np.ones(len(tags), np.int32)
        seen = idx >= 0
        counts[seen] = self._counts.payload(idx[seen]) + 1
        # Re-push the counted keys at the young end: the least recently offered keys are
        # forgotten first.
        self._counts.discard(tags[seen])
        self._counts.push(tags, np.minimum(counts, self.threshold))
        admitted: npt.NDArray[np.bool_] = counts >= self.threshold
        self.skipped += int((~admitted).sum())
        return admitted
