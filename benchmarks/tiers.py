"""The disk tier's write and read throughput against fio on the same path.

Run with the project's venv: ``.venv/bin/python benchmarks/tiers.py [--quick]
[--path DIR] [--trial-mib N] [--trials N]`` (needs ``fio``: ``apt-get install fio``).

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

Not yet here: the long-document workload's second pass served from disk and a warm
restart, which come once the tier is wired into the connector.

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--path", default="/var/tmp", help="a directory on the disk to test")
    parser.add_argument("--trial-mib", type=int, default=TRIAL_MIB)
    parser.add_argument("--trials", type=int, default=TRIALS)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_TRIALS} trials")
    args = parser.parse_args()
    if shutil.which("fio") is None:
        raise SystemExit("fio is not installed (apt-get install -y fio)")
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
    print(json.dumps(result))


if __name__ == "__main__":
    main()
