"""The ``kvferry`` command (also ``python -m kvferry``).

- ``kvferry check-config '<json or @file>'``: validate a ``--kv-transfer-config`` without
  starting vLLM; each bad key is named with its reason, and the exit status is 1 if any.
- ``kvferry top URL``: a live terminal view of a server's ``vllm:kvferry_*`` metrics
  (``--once``: one frame, for scripts). Needs ``pip install 'kvferry[cli]'``.
- ``kvferry traces summarize|merge|check FILE...``: trace files in the terminal (see
  docs/tracing.md).
- ``kvferry metrics``: the table of kvferry's metrics (``--markdown``: docs/metrics.md).

None of them imports vLLM: they run on a laptop next to a server as well as on it.
"""

from __future__ import annotations

import argparse
import ast
import http.client
import importlib.util
import json
import math
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import attrs

from ._errors import ConfigError
from ._metrics import LOAD_FAILURES, METRICS, PREFIX, reference_markdown

EXIT_OK, EXIT_BAD, EXIT_USAGE = 0, 1, 2
CONNECTOR = "KVFerryConnector"
MODULE_PATH = "kvferry.connector"
EXTRA = "kv_connector_extra_config"


class CliError(Exception):
    """Input the command cannot use at all (not JSON, a file or server not there)."""


# -- check-config --------------------------------------------------------------------------


@attrs.frozen
class Finding:
    key: str
    message: str
    error: bool = True

    def __str__(self) -> str:
        return f"{'error' if self.error else 'warning'}: {self.key}: {self.message}"


def read_json_argument(text: str) -> Any:
    """The JSON in ``text``, or in the file it names as ``@path``."""
    source = "the argument"
    if text.startswith("@"):
        source = text[1:]
        try:
            text = Path(source).read_text(encoding="utf-8")
        except OSError as exc:
            raise CliError(f"cannot read {source}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise CliError(f"{source} is not UTF-8 text: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CliError(f"{source} is not JSON: {exc}") from None


def vllm_transfer_config_fields() -> frozenset[str] | None:
    """The field names of the installed vLLM's ``KVTransferConfig``, or None without vLLM.

    Read from vLLM's source rather than imported: importing ``vllm.config`` takes seconds,
    and a config check should answer at once.
    """
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(next(iter(spec.submodule_search_locations))) / "config" / "kv_transfer.py"
    try:
        tree = ast.parse(source.read_text())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "KVTransferConfig":
            return frozenset(
                stmt.target.id
                for stmt in node.body
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
            )
    return None


def check_extra_config(extra: Any, *, engine_block_size: int | None = None) -> list[Finding]:
    """Every problem of a ``kv_connector_extra_config``, one finding per bad key.

    Each key is validated on its own by :meth:`FerryConfig.from_dict` (beside a valid
    ``cpu_bytes_to_use`` when it is not that key), so that this check says exactly what
    engine start would, for all keys at once rather than the first one. When every key
    is good alone, the whole config is validated once more, for the checks that involve
    several keys (a redis tier needs a runtime other than "stepped").
    """
    from ._config import FerryConfig

    if not isinstance(extra, Mapping):
        return [Finding(EXTRA, f"must be a JSON object, got {type(extra).__name__}")]
    findings: list[Finding] = []
    if "cpu_bytes_to_use" not in extra:
        findings.append(Finding("cpu_bytes_to_use", "is required (bytes of host memory to use)"))
    known = set(FerryConfig.KEYS)
    for key, value in extra.items():
        if key not in known:
            findings.append(
                Finding(key, f"unknown key (known keys: {', '.join(FerryConfig.KEYS)})")
            )
            continue
        alone = {key: value} if key == "cpu_bytes_to_use" else {"cpu_bytes_to_use": 1, key: value}
        try:
            cfg = FerryConfig.from_dict(alone)
            if key == "block_size" and engine_block_size is not None:
                cfg.blocks_per_chunk(engine_block_size)
        except ConfigError as exc:
            findings.append(Finding(exc.key, exc.detail))
    if not findings:
        try:
            FerryConfig.from_dict(extra)
        except ConfigError as exc:
            findings.append(Finding(exc.key, exc.detail))
    return findings


def check_transfer_config(
    config: Any, *, engine_block_size: int | None = None
) -> tuple[list[Finding], list[str]]:
    """Findings for a whole ``--kv-transfer-config``, and notes on what was not checked.

    A bare ``kv_connector_extra_config`` (an object without ``kv_connector``) is taken
    as such, so either JSON can be checked.
    """
    notes: list[str] = []
    if not isinstance(config, Mapping):
        return [Finding("(config)", f"must be a JSON object, got {type(config).__name__}")], notes
    if "kv_connector" not in config and EXTRA not in config:
        notes.append(f"no 'kv_connector' key: checked as a {EXTRA}")
        return check_extra_config(config, engine_block_size=engine_block_size), notes
    findings: list[Finding] = []
    if config.get("kv_connector") != CONNECTOR:
        findings.append(
            Finding("kv_connector", f"must be {CONNECTOR!r}, got {config.get('kv_connector')!r}")
        )
    if config.get("kv_connector_module_path") != MODULE_PATH:
        findings.append(
            Finding(
                "kv_connector_module_path",
                f"must be {MODULE_PATH!r} (vLLM does not know kvferry by name), "
                f"got {config.get('kv_connector_module_path')!r}",
            )
        )
    role = config.get("kv_role")
    if role != "kv_both":
        findings.append(
            Finding("kv_role", f"must be 'kv_both' (kvferry stores and loads), got {role!r}")
        )
    if "kv_load_failure_policy" in config:
        findings.append(
            Finding(
                "kv_load_failure_policy",
                f"is set by kvferry from {EXTRA}.on_load_failure; this value is replaced",
                error=False,
            )
        )
    fields = vllm_transfer_config_fields()
    if fields is None:
        notes.append("vLLM is not installed here: vLLM's own keys were not checked")
    else:
        for key in config:
            if key not in fields:
                findings.append(Finding(key, "not a key of vLLM's KVTransferConfig (a typo?)"))
    if EXTRA not in config:
        findings.append(Finding(EXTRA, "is required (kvferry needs at least cpu_bytes_to_use)"))
    else:
        findings += [
            Finding(f"{EXTRA}.{f.key}", f.message, f.error)
            for f in check_extra_config(config[EXTRA], engine_block_size=engine_block_size)
        ]
    return findings, notes


def cmd_check_config(args: argparse.Namespace, out: TextIO) -> int:
    config = read_json_argument(args.config)
    findings, notes = check_transfer_config(config, engine_block_size=args.block_size)
    for f in findings:
        print(f, file=out)
    for n in notes:
        print(f"note: {n}", file=out)
    errors = sum(f.error for f in findings)
    if errors:
        print(f"{errors} bad key{'s' if errors > 1 else ''}", file=out)
        return EXIT_BAD
    print("ok", file=out)
    return EXIT_OK


# -- top -----------------------------------------------------------------------------------


def metrics_url(url: str) -> str:
    """``URL`` as given, with ``/metrics`` added to a bare server address."""
    if "://" not in url:
        url = "http://" + url
    scheme, _, rest = url.partition("://")
    if "/" not in rest or rest.endswith("/") and rest.count("/") == 1:
        url = f"{scheme}://{rest.rstrip('/')}/metrics"
    return url


def scrape(url: str, timeout_s: float = 10.0) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            body: bytes = resp.read()
    # ValueError: a URL that does not parse ("http://[::1"); HTTPException: one whose
    # port is not a number (InvalidURL), or a server that does not answer in HTTP.
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", exc)
        raise CliError(f"cannot read {url}: {reason}") from None
    return body.decode("utf-8", errors="replace")


Series = dict[tuple[str, str], dict[str, float]]
"""(model_name, engine) -> sample name -> value."""


def kvferry_series(text: str) -> Series:
    """kvferry's samples in a Prometheus text page, per (model, engine); ``ValueError``
    if ``text`` is not one."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Series = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(PREFIX):
                who = (s.labels.get("model_name", "?"), s.labels.get("engine", "0"))
                values = out.setdefault(who, {})
                values[s.name] = values.get(s.name, 0.0) + s.value
    return out


def read_series(url: str) -> Series:
    """kvferry's samples at ``url``; a :class:`CliError` if it cannot be read or is not
    a Prometheus text page (a URL of another server, or of its HTML page)."""
    text = scrape(url)
    try:
        return kvferry_series(text)
    except ValueError as exc:
        raise CliError(f"{url} is not a Prometheus metrics page: {exc}") from None


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


@attrs.frozen(kw_only=True)
class Frame:
    """What one screen of ``top`` shows for one engine, computed from two scrapes."""

    model: str
    engine: str
    values: dict[str, float]
    rates: dict[str, float] | None
    """Per-second increments since the previous scrape; None on the first."""

    def get(self, name: str) -> float:
        return self.values.get(f"{PREFIX}{name}_total", self.values.get(PREFIX + name, 0.0))

    def rate(self, name: str) -> float | None:
        return None if self.rates is None else self.rates.get(f"{PREFIX}{name}_total", 0.0)


def frames(now: Series, before: Series | None, interval_s: float) -> list[Frame]:
    out = []
    for (model, engine), values in sorted(now.items()):
        rates = None
        if before is not None and (model, engine) in before and interval_s > 0:
            prev = before[(model, engine)]
            rates = {
                k: max(0.0, v - prev.get(k, 0.0)) / interval_s
                for k, v in values.items()
                if k.endswith("_total")
            }
        out.append(Frame(model=model, engine=engine, values=values, rates=rates))
    return out


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def render_frame(frame: Frame) -> Any:
    """A rich table for one engine: hit rate, GB/s per direction and tier, occupancy,
    failures; "now" is the last interval, "total" since the server started."""
    from rich.table import Table

    f = frame
    table = Table(
        title=f"kvferry  model={f.model} engine={f.engine}", title_justify="left", expand=False
    )
    table.add_column("", style="bold")
    table.add_column("now", justify="right")
    table.add_column("total", justify="right")
    hit_now = None
    if f.rates is not None:
        hit_now = _ratio(f.rate("tokens_hit") or 0.0, f.rate("tokens_looked_up") or 0.0)
    table.add_row(
        "hit rate (tokens hit / looked up)",
        _fmt(hit_now, ".1%"),
        _fmt(_ratio(f.get("tokens_hit"), f.get("tokens_looked_up")), ".1%"),
    )
    for label, name in (("tokens loaded", "tokens_loaded"), ("tokens stored", "tokens_stored")):
        table.add_row(label, _fmt(f.rate(name), ",.0f", "/s"), f"{f.get(name):,.0f}")
    for direction, arrow in (("load", "host -> device"), ("store", "device -> host")):
        # "now": bytes moved per second of wall time; "total": while copying (bytes/copy s).
        now = f.rate(f"{direction}_bytes")
        table.add_row(
            f"{direction} GB/s, host tier ({arrow})",
            _fmt(None if now is None else now / 1e9, ".3f"),
            _fmt(
                _ratio(f.get(f"{direction}_bytes") / 1e9, f.get(f"{direction}_seconds")),
                ".3f",
                " in copies",
            ),
        )
    used, capacity = f.get("host_blocks_used"), f.get("host_blocks_capacity")
    table.add_row(
        "host occupancy (blocks)",
        "",
        f"{used:,.0f} / {capacity:,.0f} ({_fmt(_ratio(used, capacity), '.1%')})",
    )
    table.add_row(
        "evictions", _fmt(f.rate("evictions"), ",.1f", "/s"), f"{f.get('evictions'):,.0f}"
    )
    failures = ("loads_failed", "stores_failed", "unknown_metrics")
    failed = sum(f.get(n) for n in failures)
    table.add_row(
        "failures (loads, stores, metrics)",
        "",
        ", ".join(f"{f.get(n):,.0f}" for n in failures),
        style="red" if failed else None,
    )
    if f.get("loads_failed"):
        table.add_row(
            "loads failed by cause",
            "",
            ", ".join(
                f"{cause} {f.get(name):,.0f}" for cause, name in LOAD_FAILURES if f.get(name)
            ),
            style="red",
        )
    table.add_row(
        "stores skipped / fenced, lookups deferred",
        "",
        ", ".join(
            f"{f.get(n):,.0f}" for n in ("stores_skipped", "stores_fenced", "lookups_deferred")
        ),
    )
    return table


def render(url: str, fs: list[Frame]) -> Any:
    from rich.console import Group
    from rich.text import Text

    when = time.strftime("%H:%M:%S")
    if not fs:
        return Text(
            f"{url} at {when}: no vllm:kvferry_* metrics (is kvferry the server's KV connector?)"
        )
    return Group(Text(f"{url} at {when}", style="dim"), *(render_frame(f) for f in fs))


def cmd_top(args: argparse.Namespace, out: TextIO) -> int:
    try:
        from rich.console import Console
        from rich.live import Live
    except ImportError:
        raise CliError("kvferry top needs rich: pip install 'kvferry[cli]'") from None
    url = metrics_url(args.url)
    console = Console(file=out)
    before: Series | None = None
    before_t = 0.0
    if args.once:
        fs = frames(read_series(url), None, 0.0)
        console.print(render(url, fs))
        return EXIT_OK if fs else EXIT_BAD
    count = 0
    with Live(console=console, auto_refresh=False, transient=False) as live:
        while True:
            t = time.monotonic()
            now = read_series(url)
            live.update(render(url, frames(now, before, t - before_t)), refresh=True)
            before, before_t = now, t
            count += 1
            if args.count and count >= args.count:
                return EXIT_OK
            time.sleep(max(0.0, args.interval - (time.monotonic() - t)))


# -- traces and metrics --------------------------------------------------------------------


def cmd_traces(args: argparse.Namespace, out: TextIO) -> int:
    from .traces._jaeger import check_document, merge_documents
    from .traces._summary import load_documents, load_trace_files, summarize

    # summarize and merge take only what check_document passes; check reports the rest.
    load = load_documents if args.traces_command == "check" else load_trace_files
    try:
        docs = load(args.files)
    except (OSError, ValueError) as exc:
        raise CliError(str(exc)) from None
    if args.traces_command == "summarize":
        out.write(summarize(docs, max_traces=args.traces, request_id=args.request))
        return EXIT_OK
    if args.traces_command == "merge":
        try:
            with open(args.output, "w") as f:
                json.dump(merge_documents(docs), f)
        except OSError as exc:
            raise CliError(f"cannot write {args.output}: {exc.strerror or exc}") from None
        return EXIT_OK
    bad = 0
    for path, doc in zip(args.files, docs, strict=True):
        problems = check_document(doc)
        bad += bool(problems)
        for p in problems:
            print(f"{path}: {p}", file=out)
        if not problems:
            print(f"{path}: ok", file=out)
    return EXIT_BAD if bad else EXIT_OK


def cmd_metrics(args: argparse.Namespace, out: TextIO) -> int:
    if args.markdown:
        out.write(reference_markdown())
        return EXIT_OK
    width = max(len(m.sample_name) for m in METRICS)
    for m in METRICS:
        print(f"{m.sample_name:<{width}}  {m.kind:<7}  {m.unit:<7}  {m.help}", file=out)
    return EXIT_OK


# -- the parser ----------------------------------------------------------------------------


# argparse types: a value out of range is a usage error (exit status 2), not a traceback.


def _whole_number(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value


def positive_int(text: str) -> int:
    """A whole number >= 1."""
    return _whole_number(text, 1)


def non_negative_int(text: str) -> int:
    """A whole number >= 0."""
    return _whole_number(text, 0)


def seconds(text: str) -> float:
    """A finite number of seconds >= 0 (``time.sleep`` cannot wait forever)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvferry",
        description="kvferry, a vLLM KV connector that offloads KV cache to host memory.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser(
        "check-config",
        help="validate a --kv-transfer-config without starting vLLM",
        description="Validate a --kv-transfer-config (or a bare kv_connector_extra_config) "
        "without starting vLLM. Each bad key is named with its reason; exit status 1 if "
        "any, 2 if the input is not JSON.",
    )
    c.add_argument("config", help="the JSON, or @FILE to read it from a file")
    c.add_argument(
        "--block-size",
        type=positive_int,
        metavar="TOKENS",
        help="vLLM's block size, to check block_size against it (vLLM's default is 16 on "
        "GPUs, 128 on CPUs)",
    )
    c.set_defaults(handler=cmd_check_config)

    t = sub.add_parser(
        "top",
        help="live view of a server's kvferry metrics",
        description="A live view of the vllm:kvferry_* metrics of a running vLLM server: "
        "hit rate, GB/s per direction and tier, host occupancy, failures. Needs "
        "pip install 'kvferry[cli]'.",
    )
    t.add_argument("url", help="the server (http://host:8000) or its /metrics URL")
    t.add_argument("--once", action="store_true", help="print one frame and exit")
    t.add_argument(
        "--interval", type=seconds, default=1.0, metavar="S", help="seconds between frames"
    )
    t.add_argument(
        "--count",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="exit after N frames (0: never)",
    )
    t.set_defaults(handler=cmd_top)

    tr = sub.add_parser(
        "traces",
        help="trace files in the terminal",
        description="Look at kvferry's trace files (Jaeger JSON, written with "
        '"traces": {"file": true}); see docs/tracing.md.',
    )
    trs = tr.add_subparsers(dest="traces_command", required=True, metavar="COMMAND")
    s = trs.add_parser(
        "summarize",
        help="timelines per request and latency percentiles",
        description="A timeline per request and latency percentiles per span name; the "
        "files of all processes are merged by trace id first.",
    )
    s.add_argument("files", nargs="+", metavar="FILE")
    s.add_argument(
        "--traces", type=int, default=20, metavar="N", help="timelines to print (0: all)"
    )
    s.add_argument("--request", metavar="ID", help="only the trace of this request id")
    m = trs.add_parser("merge", help="merge files by trace id for Jaeger UI")
    m.add_argument("files", nargs="+", metavar="FILE")
    m.add_argument("-o", "--output", required=True)
    k = trs.add_parser("check", help="check files against what Jaeger UI reads")
    k.add_argument("files", nargs="+", metavar="FILE")
    tr.set_defaults(handler=cmd_traces)

    me = sub.add_parser(
        "metrics",
        help="the table of kvferry's metrics",
        description="Every vllm:kvferry_* metric: name, kind, unit, meaning.",
    )
    me.add_argument("--markdown", action="store_true", help="as docs/metrics.md")
    me.set_defaults(handler=cmd_metrics)
    return parser


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace, TextIO], int] = args.handler
    try:
        return handler(args, out or sys.stdout)
    except CliError as exc:
        print(f"kvferry {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
