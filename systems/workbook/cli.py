"""The workbook's command line.

    python -m systems.workbook run [--only 01 03] [--profile auto|smoke|full] [--out-dir DIR] [-p NAME VALUE]
    python -m systems.workbook list
    python -m systems.workbook report [--out-dir DIR]
    python -m systems.workbook submit|status ...   (Slurm batch jobs: systems.workbook.slurm)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from systems.config import HANDOUTS
from systems.measure.env import REPO_ROOT
from systems.workbook import slurm
from systems.workbook.html import ReportError, build_report
from systems.workbook.notebooks import WorkbookError, discover, parse_value, run_notebooks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m systems.workbook", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="execute notebooks and export the report")
    run.add_argument("--only", nargs="+", help="notebook numbers or names, e.g. 01 03")
    run.add_argument("--profile", default="auto", choices=["auto", "smoke", "full"],
                     help="auto: full with CUDA, smoke without")
    run.add_argument("--out-dir", help="where figures/, results/ and writeup/ go (default: build/full or "
                     "build/smoke; --out-dir . updates the committed outputs)")
    run.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                     help="extra papermill parameter (JSON value, else string)")
    run.add_argument("--stop-on-error", action="store_true", help="stop at the first failing notebook")
    run.add_argument("--no-progress", action="store_true")
    run.add_argument("--allow-dirty", action="store_true",
                     help="let a full-profile run start with uncommitted changes (stamped on every row)")
    sub.add_parser("list", help="list the notebooks")
    rep = sub.add_parser("report", help="rebuild writeup/report.html from executed notebooks")
    rep.add_argument("--out-dir", default=str(REPO_ROOT))
    rep.add_argument("--handout", choices=HANDOUTS, default=None,
                     help="whose deliverables the index lists (default: the handout the notebooks ran with)")
    slurm.add_commands(sub)
    args = parser.parse_args(argv)
    if args.command in slurm.COMMANDS:
        return slurm.run_command(args)

    try:
        if args.command == "list":
            for p in discover():
                print(p.stem)
            return 0
        if args.command == "report":
            print(build_report(Path(args.out_dir).resolve(), handout=args.handout))
            return 0
        runs = run_notebooks(only=args.only, profile=args.profile, out_dir=args.out_dir,
                             parameters={k: parse_value(v) for k, v in args.parameter},
                             keep_going=not args.stop_on_error, progress=not args.no_progress,
                             allow_dirty=args.allow_dirty)
    except (WorkbookError, ReportError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    failed = [r for r in runs if not r.ok]
    for r in failed:
        where = f"\n  partial output: {r.output}" if r.output else ""
        print(f"FAILED {r.name}: {r.error}{where}", file=sys.stderr)
    return 1 if failed else 0


