"""``python -m kvferry.traces``: look at trace files from the terminal.

- ``summarize FILE [FILE...]``: a timeline per request and latency percentiles per span
  name, the files of all processes merged by trace id;
- ``merge FILE [FILE...] -o OUT``: one file for Jaeger UI's "JSON file" upload, so that a
  trace shows the scheduler's and the workers' spans together;
- ``check FILE [FILE...]``: what in a file Jaeger UI would trip on (exit 1 if anything).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ._jaeger import check_document, merge_documents
from ._summary import load_documents, load_trace_files, summarize


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvferry.traces",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("summarize", help="timelines and latency percentiles")
    s.add_argument("files", nargs="+")
    s.add_argument(
        "--traces",
        type=int,
        default=20,
        metavar="N",
        help="timelines to print (0: all; default 20)",
    )
    s.add_argument("--request", metavar="ID", help="only the trace of this request id")
    m = sub.add_parser("merge", help="merge files by trace id for Jaeger UI")
    m.add_argument("files", nargs="+")
    m.add_argument("-o", "--output", required=True)
    c = sub.add_parser("check", help="check files against what Jaeger UI reads")
    c.add_argument("files", nargs="+")
    args = parser.parse_args(argv)

    # summarize and merge take only what check_document passes; check reports the rest.
    load = load_documents if args.command == "check" else load_trace_files
    try:
        docs = load(args.files)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.command == "summarize":
        sys.stdout.write(summarize(docs, max_traces=args.traces, request_id=args.request))
        return 0
    if args.command == "merge":
        try:
            with open(args.output, "w") as f:
                json.dump(merge_documents(docs), f)
        except OSError as exc:
            print(f"error: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        return 0
    bad = 0
    for path, doc in zip(args.files, docs, strict=True):
        problems = check_document(doc)
        bad += bool(problems)
        for p in problems:
            print(f"{path}: {p}")
        if not problems:
            print(f"{path}: ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
