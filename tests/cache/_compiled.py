"""``both``: a test's ``compiled`` parameter, False (numpy or Python) and True (numba's
kernels, where numba is installed)."""

from __future__ import annotations

import pytest

from kvferry.cache import _kernels

both = pytest.mark.parametrize(
    "compiled",
    [
        pytest.param(False, id="numpy"),
        pytest.param(
            True,
            id="compiled",
            marks=pytest.mark.skipif(_kernels.load() is None, reason="numba is not installed"),
        ),
    ],
)
