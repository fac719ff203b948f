"""``ddiloco`` command line: simulate | goodput (more subcommands come with the real runtime)."""

from __future__ import annotations

import argparse
import sys
import warnings

from ddiloco.errors import DDiLoCoError

SUMMARY_ROWS = [
    ("eval loss (nats/byte)", "eval_loss", "{:.4f}"),
    ("tokens processed", "tokens_processed", "{:,.0f}"),
    ("tokens merged", "tokens_merged", "{:,.0f}"),
    ("merged / processed", "merged_share", "{:.1%}"),
    ("goodput", "goodput", "{:.1%}"),
    ("  lost: blocked", "blocked", "{:.1%}"),
    ("  lost: down", "down", "{:.1%}"),
    ("  lost: restarting", "restarting", "{:.1%}"),
    ("uptime", "uptime", "{:.1%}"),
    ("failures", "failures", "{:.0f}"),
    ("work lost in failures (steps)", "lost_steps", "{:.0f}"),
    ("fragments P", "num_fragments", "{:.0f}"),
    ("rounds per fragment", "rounds_per_fragment", "{:.1f}"),
    ("mean learners per merge", "learners_per_merge", "{:.2f}"),
    ("grace admissions", "grace_admissions", "{:.0f}"),
    ("rejected / late answers", "rejected", "{:.0f}"),
    ("virtual time (s)", "virtual_time_s", "{:.1f}"),
]


def summary_table(summary: dict, title: str):
    from rich.table import Table

    table = Table(title=title)
    table.add_column("measure")
    table.add_column("value", justify="right")
    for label, key, fmt in SUMMARY_ROWS:
        value = fmt.format(summary[key])
        if key == "rejected":
            value = f"{summary['rejected']} / {summary['late']}"
        table.add_row(label, value)
    return table


def cmd_simulate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from ddiloco.config import load_config
    from ddiloco.methods import PRESETS
    from ddiloco.runtime.rundir import write_run_dir
    from ddiloco.runtime.run import simulate

    overrides = list(args.set or [])
    method = args.method or _method_in(args.config, overrides) or "decoupled"
    if method not in PRESETS:
        raise DDiLoCoError(f"--method {method!r} is not known; allowed: {', '.join(PRESETS)}")
    if args.config is None:
        overrides = ["chaos.enabled=true", 'chaos.stragglers=["1:2.0"]'] * (method != "dp") + overrides
    overrides.append(f"run.method={method}")
    cfg = load_config(args.config, overrides, base=PRESETS[method])
    console = Console(stderr=True)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}% of virtual time"), TimeElapsedColumn(), console=console, transient=False) as progress:
        task = progress.add_task(f"simulating {method}, M={cfg.run.num_learners}", total=1.0)
        result = simulate(cfg, on_progress=lambda t, T: progress.update(task, completed=t / T))
    out = write_run_dir(cfg.run.run_dir, cfg, result)
    Console().print(summary_table(result.summary(), f"ddiloco simulate --method {method}"))
    Console().print(f"run folder: {out}")
    return 0


def _method_in(path: str | None, overrides: list[str]) -> str | None:
    for o in overrides:
        if o.replace(" ", "").startswith("run.method="):
            return o.split("=", 1)[1].strip().strip("\"'")
    if path:
        from ddiloco.config import tomllib

        try:
            with open(path, "rb") as f:
                return tomllib.load(f).get("run", {}).get("method")
        except (OSError, tomllib.TOMLDecodeError):
            return None  # load_config reports the problem with one clear line
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddiloco", description="Decoupled DiLoCo: resilient, low-communication distributed pre-training.")
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser("simulate", help="train in deterministic virtual time (M learners in one process)")
    sim.add_argument("config", nargs="?", help="TOML config file (sections run, workload, algo, inner, sim, chaos)")
    sim.add_argument("--method", choices=["dp", "diloco", "streaming", "decoupled"], help="method preset (default: decoupled)")
    sim.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config value (repeatable)")
    sim.set_defaults(func=cmd_simulate)
    gp = sub.add_parser("goodput", help="datacenter-scale goodput and bandwidth simulator", add_help=False)
    gp.add_argument("rest", nargs=argparse.REMAINDER)
    gp.set_defaults(func=lambda a: _goodput(a.rest))
    return parser


def _goodput(argv: list[str]) -> int:
    from ddiloco.goodput.cli import main as goodput_main

    return goodput_main(argv)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.formatwarning = lambda msg, *a, **k: f"warning: {msg}\n"
            return int(args.func(args) or 0)
    except DDiLoCoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
