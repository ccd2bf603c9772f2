"""`make demo`: kvferry on vLLM (CPU) with a tiny random-weight Llama, on long-document QA.

Documents that together do not fit the engine's own KV cache are asked once (pass 1),
then re-asked in another order (pass 2): first with kvferry on, where pass 2 loads the
documents' KV from host memory, then, from the same starting point, with kvferry turned
off for each request (``kv_transfer_params={"kvferry": {"load": false, "store":
false}}``), which is vLLM's prefix caching alone. One engine serves both, so both run on
the same cores with the same compiled model.

What it shows: a progress bar per phase, a table of the passes, a PNG chart of each
pass-2 request's latency with and without kvferry (tokens loaded marked), and the trace
of one request's KV journey (``kvferry traces summarize``). vLLM's own logs, and those of
the processes it starts, go to a file whose path is printed.

Needs the ``demo`` extra (``pip install 'kvferry[demo]'``: rich, matplotlib).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import attrs

NUM_DOCS, DOC_TOKENS, ENGINE_BLOCKS = 10, 1500, 32  # 12 blocks of 128 tokens per document
MAX_TOKENS = 8
CPU_BYTES = 256 << 20
CHART_INCHES, CHART_DPI = (10.0, 5.5), 100
CHART_SIZE_PX = (1000, 550)  # CHART_INCHES * CHART_DPI: what the test checks
OFF = {"kv_transfer_params": {"kvferry": {"load": False, "store": False}}}


@attrs.frozen(kw_only=True)
class Request:
    doc: int
    request_id: str
    seconds: float
    tokens: list[int]
    cached: int
    """Prompt tokens vLLM did not compute (its own prefix cache + kvferry's loads)."""
    loaded: int
    """Prompt tokens kvferry loaded from host memory."""


@attrs.frozen(kw_only=True)
class Pass:
    name: str
    requests: list[Request]

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.requests)

    def by_doc(self) -> dict[int, Request]:
        return {r.doc: r for r in self.requests}


@attrs.frozen(kw_only=True)
class Result:
    args: argparse.Namespace
    pass1_on: Pass
    pass2_on: Pass
    pass1_off: Pass
    pass2_off: Pass
    engine_start_s: float
    log: Path
    chart: Path
    trace_files: list[Path]
    total_s: float

    @property
    def matched(self) -> bool:
        off = {**self.pass1_off.by_doc(), **self.pass2_off.by_doc()}
        return all(
            r.tokens == off[r.doc].tokens for p in (self.pass1_on, self.pass2_on)
            for r in p.requests
        )  # fmt: skip


# -- where output goes ---------------------------------------------------------------------


@contextlib.contextmanager
def output_to_file(log: Path) -> Iterator[TextIO]:
    """Send file descriptors 1 and 2 to ``log`` and yield the terminal.

    vLLM logs from this process and from the processes it starts (engine core, workers,
    their resource tracker), and some of it is C++ and tqdm writing straight to the file
    descriptors; redirecting at the descriptor level, before anything starts, is the one
    way that catches all of it: children inherit the descriptors.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    terminal = os.fdopen(os.dup(saved_out), "w", buffering=1)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield terminal
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        for f in (fd, saved_out, saved_err):
            os.close(f)
        terminal.close()


_LOG_PREFIX = re.compile(r"^(\(\S+ pid=\d+\) )?[A-Z]+ \d\d-\d\d [\d:]+ \[[^\]]*\] ")


class LogFollower:
    """Reads the log file as it grows and keeps its last line from vLLM's logger, so the
    engine-start bar can say what vLLM is doing."""

    def __init__(self, log: Path) -> None:
        self._log = log
        self._stop = threading.Event()
        self.last = ""
        self._thread = threading.Thread(target=self._run, name="log-follower", daemon=True)

    def __enter__(self) -> LogFollower:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with self._log.open(errors="replace") as f:
            f.seek(0, os.SEEK_END)
            while not self._stop.wait(0.2):  # a display refresh, not a synchronisation
                for line in f.readlines():
                    m = _LOG_PREFIX.match(line)
                    if m:
                        self.last = line[m.end() :].strip()


# -- the run -------------------------------------------------------------------------------


def ask(
    llm: Any, docs: list[list[int]], order: list[int], *, on: bool, advance: Any
) -> list[Request]:
    """Each document of ``order`` alone, greedily, timed from submission to its answer."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, extra_args=None if on else OFF
    )
    out = []
    for d in order:
        t0 = time.perf_counter()
        [o] = llm.generate([TokensPrompt(prompt_token_ids=docs[d])], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        info = (o.kv_transfer_params or {}).get("kvferry") or {}
        out.append(
            Request(
                doc=d,
                request_id=o.request_id,
                seconds=seconds,
                tokens=list(o.outputs[0].token_ids),
                cached=o.num_cached_tokens or 0,
                loaded=int(info.get("tokens_loaded", 0)),
            )
        )
        advance()
    return out


def run(args: argparse.Namespace, out_dir: Path) -> Result:
    """The whole demo, with vLLM's output in ``out_dir/vllm.log`` and progress bars on the
    terminal."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    t_start = time.perf_counter()
    log = out_dir / "vllm.log"
    with output_to_file(log) as terminal:
        progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description:<30}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("[dim]{task.fields[doing]}"),
            console=Console(file=terminal, highlight=False),
            # vLLM's loggers must keep writing to the log file, not above the bars.
            redirect_stdout=False,
            redirect_stderr=False,
        )
        with progress, LogFollower(log) as follower:
            passes, engine_start_s = phases(args, out_dir, progress, follower)
    chart = out_dir / "pass2-latency.png"
    draw_chart(passes[3], passes[1], chart, args)
    return Result(
        args=args,
        pass1_on=passes[0],
        pass2_on=passes[1],
        pass1_off=passes[2],
        pass2_off=passes[3],
        engine_start_s=engine_start_s,
        log=log,
        chart=chart,
        trace_files=sorted((out_dir / "traces").glob("*.json")),
        total_s=time.perf_counter() - t_start,
    )


def phases(
    args: argparse.Namespace, out_dir: Path, progress: Any, follower: LogFollower
) -> tuple[list[Pass], float]:
    """Engine start, then pass 1 and pass 2 with kvferry, then both again without."""
    from kvferry.testing import (
        close_engine,
        engine_args,
        equal_cpu_threads,
        long_doc_prompts,
        make_tiny_model,
        reask_order,
    )

    docs = long_doc_prompts(args.docs, args.doc_tokens)
    warm = long_doc_prompts(1, args.doc_tokens, seed=99)
    first, second = list(range(args.docs)), reask_order(args.docs)

    start = progress.add_task("engine start", total=None, doing="importing vLLM")
    done = threading.Event()

    def show_log() -> None:
        while not done.wait(0.25):  # a display refresh, not a synchronisation
            progress.update(start, doing=follower.last[:60])

    shower = threading.Thread(target=show_log, name="engine-start-status", daemon=True)
    shower.start()
    t0 = time.perf_counter()
    equal_cpu_threads()
    from vllm import LLM

    model = make_tiny_model(out_dir / "tiny-llama")
    kvferry = {
        "cpu_bytes_to_use": CPU_BYTES,
        "traces": {"file": str(out_dir / "traces" / "kvferry-{role}-{pid}.json")},
    }
    llm = LLM(**engine_args(model, kvferry=kvferry, num_gpu_blocks=ENGINE_BLOCKS))
    # Warm-up: compile, then one store and one load, so that pass 1 times no first use.
    ask(llm, warm, [0], on=True, advance=lambda: None)
    llm.reset_prefix_cache()
    ask(llm, warm, [0], on=True, advance=lambda: None)
    llm.reset_prefix_cache(reset_connector=True)
    engine_start_s = time.perf_counter() - t0
    done.set()
    shower.join()
    progress.update(start, total=1, completed=1, doing=f"ready in {engine_start_s:.0f} s")

    def phase(title: str, order: list[int], on: bool) -> Pass:
        task = progress.add_task(title, total=len(order), doing="one request at a time")
        reqs = ask(llm, docs, order, on=on, advance=lambda: progress.advance(task))
        progress.update(task, doing=f"{sum(r.seconds for r in reqs):.1f} s")
        return Pass(name=title, requests=reqs)

    passes = [
        phase("pass 1, kvferry storing", first, True),
        phase("pass 2, kvferry loading", second, True),
    ]
    # The same two passes from the same start (an empty engine cache), kvferry off.
    llm.reset_prefix_cache()
    passes += [
        phase("pass 1, prefix caching alone", first, False),
        phase("pass 2, prefix caching alone", second, False),
    ]
    closing = progress.add_task("engine stop", total=None, doing="flushing traces")
    close_engine(llm)
    progress.update(closing, total=1, completed=1, doing="")
    return passes, engine_start_s


# -- what it shows -------------------------------------------------------------------------


def draw_chart(alone: Pass, ferry: Pass, path: Path, args: argparse.Namespace) -> None:
    """Grouped bars: each pass-2 request's latency without and with kvferry, in pass-2
    order, each kvferry bar labelled with the tokens it loaded."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none is looked for
    import matplotlib.pyplot as plt

    off = alone.by_doc()
    docs = [r.doc for r in ferry.requests]
    x = list(range(len(docs)))
    w = 0.4
    fig, ax = plt.subplots(figsize=CHART_INCHES, dpi=CHART_DPI)
    grey = ax.bar(
        [i - w / 2 for i in x],
        [off[d].seconds * 1e3 for d in docs],
        w,
        label="prefix caching alone",
        color="#9aa0a6",
    )
    for bar, d in zip(grey, docs, strict=True):
        if off[d].cached:  # the engine's own cache still held the document's first blocks
            ax.annotate(
                f"{off[d].cached:,}\nin vLLM",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=7,
                color="#5f6368",
            )
    bars = ax.bar(
        [i + w / 2 for i in x],
        [r.seconds * 1e3 for r in ferry.requests],
        w,
        label="prefix caching + kvferry",
        color="#1a73e8",
    )
    for bar, r in zip(bars, ferry.requests, strict=True):
        ax.annotate(
            f"{r.loaded:,}\nloaded" if r.loaded else "0",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(x, [f"doc {d}" for d in docs])
    ax.set_ylabel("latency (ms), one request at a time")
    ax.set_xlabel("pass-2 requests, in the order asked (labels: prompt tokens not computed)")
    ax.set_title(
        f"Re-asking {args.docs} documents of {args.doc_tokens} tokens (engine cache: "
        f"{ENGINE_BLOCKS} blocks of 128 tokens)"
    )
    ax.margins(y=0.15)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=CHART_DPI)  # never bbox_inches="tight": the size must stay fixed
    plt.close(fig)


def show(result: Result, console: Any) -> None:
    from rich.table import Table

    from kvferry.traces._summary import load_documents, rows_by_trace, summarize

    r, a = result, result.args
    table = Table(
        title=f"long-document QA: {a.docs} documents x {a.doc_tokens} tokens, engine cache "
        f"{ENGINE_BLOCKS} blocks x 128 tokens, each asked twice, one at a time",
        title_justify="left",
    )
    table.add_column("", no_wrap=True)
    for col in ("pass 1\ns", "pass 2\ns", "pass 2\nmedian ms", "pass 2 tokens\nloaded",
                "pass 2 tokens\ncached"):  # fmt: skip
        table.add_column(col, justify="right")
    for name, p1, p2 in (
        ("prefix caching alone", r.pass1_off, r.pass2_off),
        ("prefix caching + kvferry", r.pass1_on, r.pass2_on),
    ):
        table.add_row(
            name,
            f"{p1.seconds:.2f}",
            f"{p2.seconds:.2f}",
            f"{statistics.median(q.seconds for q in p2.requests) * 1e3:.0f}",
            f"{sum(q.loaded for q in p2.requests):,}",
            f"{sum(q.cached for q in p2.requests):,}",
        )
    console.print()
    console.print(table)
    speedup = r.pass2_off.seconds / r.pass2_on.seconds
    console.print(f"pass 2 with kvferry: {speedup:.1f}x faster than prefix caching alone")
    console.print(
        "outputs matched (greedy token ids, every request, both passes): "
        + ("[green]yes[/]" if r.matched else "[red]NO[/]")
    )
    console.print(f"chart of pass-2 latencies: {r.chart}")
    console.print(f"vLLM's log:                {r.log}")
    if r.trace_files:
        docs = load_documents(r.trace_files)
        # The request whose journey shows the most: the pass-2 request that loaded most.
        best = max(r.pass2_on.requests, key=lambda q: q.loaded)
        # vLLM's engine names a request "<the id LLM.generate returned>-<random suffix>".
        journey = next(
            (
                rid
                for doc in docs
                for rows in rows_by_trace(doc).values()
                for row in rows
                if isinstance(rid := row.tags.get("kvferry.request_id"), str)
                and (rid == best.request_id or rid.startswith(best.request_id + "-"))
            ),
            None,
        )
        console.print(f"traces:                    {r.trace_files[0].parent}/")
        if journey is not None:
            console.print()
            console.print(
                f"one request's KV journey (doc {best.doc} in pass 2; "
                f"kvferry traces summarize {r.trace_files[0].parent}/*.json "
                f"--request {journey}):"
            )
            text = summarize(docs, max_traces=1, request_id=journey)
            console.print(text.rstrip(), markup=False, highlight=False, soft_wrap=True)
    console.print(f"\ndone in {r.total_s:.0f} s (engine start {r.engine_start_s:.0f} s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--docs", type=int, default=NUM_DOCS)
    parser.add_argument("--doc-tokens", type=int, default=DOC_TOKENS)
    parser.add_argument("--out", type=Path, help="folder for the log, chart and traces")
    args = parser.parse_args(argv)
    try:
        from rich.console import Console
    except ImportError:
        print("the demo needs its extra: pip install 'kvferry[demo]'", file=sys.stderr)
        return 2
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="kvferry-demo-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    # A pipe or a file gets 100 columns (rich's default there is 80, too narrow for the
    # table); a terminal, its own width.
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 100)
    console.print(f"kvferry demo: vLLM's logs go to {out_dir / 'vllm.log'}")
    try:
        result = run(args, out_dir)
    except Exception as exc:  # the full traceback is in the log, next to vLLM's
        console.print(f"[red]the demo failed: {exc!r}[/]; see {out_dir / 'vllm.log'}")
        import traceback

        with (out_dir / "vllm.log").open("a") as f:
            traceback.print_exc(file=f)
        return 1
    show(result, console)
    return 0 if result.matched else 1


if __name__ == "__main__":
    sys.exit(main())
