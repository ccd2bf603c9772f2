"""KV layouts as vLLM hands them to ``register_kv_caches``, for the transfer tests.

Each builder returns a :class:`KV`: layer tensors filled with seeded random values, the
KV-cache groups, and where each layer's block dimension is (to check results without
going through the code under test).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

NB = 10  # engine blocks: no other dimension has this size
L, BS, H, D = 3, 4, 2, 8  # layers, tokens per block, KV heads, head dim


@attrs.define
class KV:
    tensors: dict[str, torch.Tensor]
    groups: list[list[str]]
    block_dim: dict[str, int]
    block_stride_bytes: int | None = None

    def block(self, name: str, b: int) -> torch.Tensor:
        """The bytes of block ``b`` of layer ``name``, read by plain indexing (on the CPU)."""
        t = self.tensors[name].movedim(self.block_dim[name], 0)[b]
        return t.contiguous().reshape(-1).view(torch.uint8).cpu()

    def snapshot(self) -> dict[str, list[torch.Tensor]]:
        return {n: [self.block(n, b).clone() for b in range(NB)] for n in self.tensors}


def _rand(*shape: int, dtype: torch.dtype, seed: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(device)


def per_layer_joined_nhd(device: str = "cpu") -> KV:
    """Per-layer tensors (blocks, 2, block_size, heads, dim): K and V joined."""
    ts = {
        f"l{i}": _rand(NB, 2, BS, H, D, dtype=torch.float16, seed=i, device=device)
        for i in range(L)
    }
    return KV(ts, [list(ts)], {n: 0 for n in ts})


def per_layer_split_nhd(device: str = "cpu") -> KV:
    """Per-layer (2, blocks, block_size, heads, dim): K and V split (flash-attn)."""
    ts = {
        f"l{i}": _rand(2, NB, BS, H, D, dtype=torch.float32, seed=i, device=device)
        for i in range(L)
    }
    return KV(ts, [list(ts)], {n: 1 for n in ts})


def per_layer_split_hnd(device: str = "cpu") -> KV:
    """Per-layer (2, blocks, heads, block_size, dim): K and V split, HND."""
    ts = {
        f"l{i}": _rand(2, NB, H, BS, D, dtype=torch.bfloat16, seed=i, device=device)
        for i in range(L)
    }
    return KV(ts, [list(ts)], {n: 1 for n in ts})


def hnd_stored_nhd_viewed(device: str = "cpu") -> KV:
    """HND in memory, handed over as a permuted NHD view (blocks, 2, block_size, heads, dim)."""
    ts = {
        f"l{i}": _rand(NB, 2, H, BS, D, dtype=torch.bfloat16, seed=i, device=device).permute(
            0, 1, 3, 2, 4
        )
        for i in range(L)
    }
    return KV(ts, [list(ts)], {n: 0 for n in ts})


def vllm_cpu(device: str = "cpu") -> KV:
    """vLLM-CPU (LBHNC): per layer (blocks, 2, block_size, heads*dim) over one allocation."""
    base = _rand(L, NB, 2, BS, H * D, dtype=torch.bfloat16, seed=7, device=device)
    ts = {f"l{i}": base[i] for i in range(L)}
    return KV(ts, [list(ts)], {n: 0 for n in ts})


def shared_split(device: str = "cpu") -> KV:
    """Layers sharing one allocation, K and V split: (layers, 2, blocks, bs, heads, dim)."""
    base = _rand(L, 2, NB, BS, H, D, dtype=torch.float16, seed=8, device=device)
    ts = {f"l{i}": base[i] for i in range(L)}
    return KV(ts, [list(ts)], {n: 1 for n in ts})


def block_outermost(device: str = "cpu") -> KV:
    """BLHNC: one tensor (blocks, layers, 2, block_size, heads, dim), a view per layer."""
    base = _rand(NB, L, 2, BS, H, D, dtype=torch.bfloat16, seed=9, device=device)
    ts = {f"l{i}": base[:, i] for i in range(L)}
    stride = L * 2 * BS * H * D * 2
    return KV(ts, [list(ts)], {n: 0 for n in ts}, block_stride_bytes=stride)


def two_groups(device: str = "cpu") -> KV:
    """HMA: two KV-cache groups (sliding, full) of different row sizes."""
    ts = {
        f"l{i}": _rand(NB, 2, BS, H, D, dtype=torch.bfloat16, seed=20 + i, device=device)
        for i in range(L)
    }
    return KV(ts, [["l0"], ["l1", "l2"]], {n: 0 for n in ts})


LAYOUTS: dict[str, Callable[..., KV]] = {
    f.__name__: f
    for f in (
        per_layer_joined_nhd,
        per_layer_split_nhd,
        per_layer_split_hnd,
        hnd_stored_nhd_viewed,
        vllm_cpu,
        shared_split,
        block_outermost,
        two_groups,
    )
}
