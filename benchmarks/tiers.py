"""The disk tier's write and read throughput against fio on the same path.

Run with the project's venv: ``.venv/bin/python benchmarks/tiers.py [--quick]
[--path DIR] [--total-mib N] [--trials N]`` (needs ``fio``: ``apt-get install fio``).

kvferry: ``TOTAL_MIB`` of chunks of ``CHUNK_MIB`` (one offloaded block of all layers)
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

Trials alternate fio and kvferry (the order swapped every trial) so a noisy neighbour
on the shared disk hits both alike; each ratio is the median over trials of kvferry
GB/s ÷ fio GB/s; raw GB/s are medians too. Files are deleted after each trial.

Not yet here: the long-document workload's second pass served from disk and a warm
restart, which come once the tier is wired into the connector.

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np

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
TOTAL_MIB = 1024
POOL_SLOTS = 64
TRIALS = 3

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


async def kvferry(directory: Path, nchunks: int, chunk: int) -> tuple[float, float]:
    """kvferry's (write, read) GB/s for ``nchunks`` chunks through the disk actor."""
    store = DiskStore(directory, nchunks * (chunk + (1 << 20)), FP)
    if not store.direct_io:
        raise RuntimeError(f"{directory} does not take O_DIRECT: the comparison would be unfair")
    slots = aligned_buffer(POOL_SLOTS * chunk).reshape(POOL_SLOTS, chunk)
    slots[:] = np.random.default_rng(0).integers(0, 256, slots.shape, dtype=np.uint8)
    keys = keys_array([i.to_bytes(32, "big") + bytes(4) for i in range(nchunks)])
    rows = np.arange(nchunks) % POOL_SLOTS
    actor = DiskIOActor(store, slots, io_depth=1, max_queued_writes=nchunks)
    async with ActorSystem() as system:
        disk = await system.spawn(actor)
        seconds: list[float] = []
        for cls, job_id in ((WriteChunks, 1), (ReadChunks, 2)):
            reply: Reply[DiskJobResult] = Reply()
            start = time.perf_counter()
            await disk.tell(cls(job_id=job_id, keys=keys, slots=rows, notify=reply))
            result = await reply.wait()
            seconds.append(time.perf_counter() - start)
            if not result.ok:
                raise RuntimeError(f"{cls.__name__} failed: {np.bincount(result.outcomes)}")
    moved = nchunks * chunk / 1e9
    return moved / seconds[0], moved / seconds[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--path", default="/var/tmp", help="a directory on the disk to test")
    parser.add_argument("--total-mib", type=int, default=TOTAL_MIB)
    parser.add_argument("--trials", type=int, default=TRIALS)
    parser.add_argument("--quick", action="store_true", help="256 MiB, 3 trials")
    args = parser.parse_args()
    if shutil.which("fio") is None:
        raise SystemExit("fio is not installed (apt-get install -y fio)")
    total = 256 if args.quick else args.total_mib
    chunk = CHUNK_MIB << 20
    nchunks = total // CHUNK_MIB
    figures: dict[str, list[float]] = {k: [] for k in ("kw", "kr", "fw", "fr")}
    for trial in range(args.trials):
        root = Path(tempfile.mkdtemp(prefix="kvferry-bench-", dir=args.path))
        try:
            order = ("fio", "kvferry") if trial % 2 == 0 else ("kvferry", "fio")
            for side in order:
                if side == "fio":
                    (root / "fio").mkdir()
                    figures["fw"].append(fio(root / "fio", "write", nchunks, chunk))
                    figures["fr"].append(fio(root / "fio", "read", nchunks, chunk))
                else:
                    w, r = anyio.run(kvferry, root / "kvferry", nchunks, chunk)
                    figures["kw"].append(w)
                    figures["kr"].append(r)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in figures.items()}
    write_ratio = statistics.median(
        k / f for k, f in zip(figures["kw"], figures["fw"], strict=True)
    )
    read_ratio = statistics.median(k / f for k, f in zip(figures["kr"], figures["fr"], strict=True))
    print(f"disk tier vs fio: {nchunks} chunks of {CHUNK_MIB} MiB, queue depth 1, O_DIRECT, ")
    print(f"{args.trials} trials in {args.path} (medians; GB/s of payload)")
    print(f"{'direction':<10} {'kvferry GB/s':>13} {'fio GB/s':>10} {'ratio':>7}")
    print(f"{'write':<10} {med['kw']:>13.2f} {med['fw']:>10.2f} {write_ratio:>7.2f}")
    print(f"{'read':<10} {med['kr']:>13.2f} {med['fr']:>10.2f} {read_ratio:>7.2f}")
    result: dict[str, Any] = {
        "disk_write_vs_fio": round(write_ratio, 3),
        "disk_read_vs_fio": round(read_ratio, 3),
        "disk_write_gbps": round(med["kw"], 3),
        "disk_read_gbps": round(med["kr"], 3),
        "fio_write_gbps": round(med["fw"], 3),
        "fio_read_gbps": round(med["fr"], 3),
        "chunk_mib": CHUNK_MIB,
        "total_mib": total,
        "trials": args.trials,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
