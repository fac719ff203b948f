"""``ddiloco`` command line: simulate | goodput (more subcommands come with the real runtime)."""

from __future__ import annotations

import argparse
import logging
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
    ("run length (s; virtual in simulate)", "virtual_time_s", "{:.1f}"),
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
    from ddiloco.report.rundir import prepare_run_dir, write_run_dir
    from ddiloco.sim.run import simulate

    overrides = list(args.set or [])
    method = args.method or _method_in(args.config, overrides) or "decoupled"
    if method not in PRESETS:
        raise DDiLoCoError(f"--method {method!r} is not known; allowed: {', '.join(PRESETS)}")
    if args.config is None and method != "dp":
        # The demo without a config file: failures plus one 2x straggler.
        overrides = ["chaos.enabled=true", 'chaos.stragglers=["1:2.0"]', *overrides]
    overrides.append(f"run.method={method}")
    cfg = load_config(args.config, overrides, base=PRESETS[method])
    prepare_run_dir(cfg.run.run_dir, "ddiloco simulate")  # refuse a foreign folder before any work
    console = Console(stderr=True)
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}% of virtual time"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
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


def _load(args: argparse.Namespace, default_method: str = "decoupled"):
    from ddiloco.config import load_config
    from ddiloco.methods import PRESETS

    overrides = list(getattr(args, "set", None) or [])
    method = getattr(args, "method", None) or _method_in(args.config, overrides) or default_method
    if method not in PRESETS or method == "dp":
        raise DDiLoCoError(f"method {method!r} cannot run on the real runtime; use decoupled, diloco or streaming")
    return load_config(args.config, [*overrides, f"run.method={method}"], base=PRESETS[method])


def cmd_syncer(args: argparse.Namespace) -> int:
    import signal

    from ddiloco.service.syncer import bind_syncer

    service = bind_syncer(_load(args), args.bind, args.run_dir, args.shard, args.num_shards, args.keys, args.insecure)
    signal.signal(signal.SIGTERM, lambda *_: service.stop())
    signal.signal(signal.SIGINT, lambda *_: service.stop())
    service.serve()
    return 0


def cmd_learner(args: argparse.Namespace) -> int:
    from ddiloco.service.learner import run_learner

    cfg = _load(args)
    if not args.syncer and not args.standalone:
        raise DDiLoCoError(
            "ddiloco learner needs --syncer tcp://HOST:PORT (one per shard), or --standalone to train alone"
        )
    device = ("cuda" if _cuda() else "cpu") if args.device == "auto" else args.device
    threads = args.threads or cfg.run.threads
    return run_learner(cfg, args.syncer, args.id, args.run_dir, device, threads, args.keys, args.insecure)


def cmd_evaluator(args: argparse.Namespace) -> int:
    from ddiloco.service.evaluator import run_evaluator
    from ddiloco.service.learner import client_keys

    keys = client_keys(args.syncer, args.keys, "observer", args.insecure)
    return run_evaluator(_load(args), args.syncer, args.run_dir, keys=keys)


def cmd_keys(args: argparse.Namespace) -> int:
    from ddiloco.service.keys import make_keys

    made = make_keys(args.dir, args.learners, args.observers)
    print(f"{len(made)} key pairs written to {args.dir} (existing ones kept). The syncer needs syncer.key_secret "
          "and every *.key; learner m needs syncer.key and learner-m.key_secret; see docs/security.md")  # fmt: skip
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    from ddiloco.service.launcher import Launcher

    overrides = list(args.set or [])
    if args.chaos:
        overrides = ["chaos.enabled=true", *overrides]
    args.set = overrides
    cfg = _load(args)
    launcher = Launcher(cfg, args.run_dir or cfg.run.run_dir)
    console = Console(stderr=True)
    with Live(console=console, refresh_per_second=2, transient=False) as live:
        launcher.on_status = lambda st: live.update(progress_table(st))
        summary = launcher.run()
    Console().print(summary_table(summary, f"ddiloco train --method {cfg.run.method} (real processes)"))
    Console().print(f"run folder: {launcher.run_dir}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from ddiloco.report.html import render_report

    print(f"report: {render_report(args.run_dirs, args.out)}")
    return 0


def progress_table(st: dict):
    from rich.table import Table

    t = Table(title=f"ddiloco train: {st['t']:.0f} / {st['T']:.0f} s, faults injected: {st['faults']}")
    for col in ("learner", "state", "steps", "steps/s", "loss", "merged back"):
        t.add_column(col, justify="right")
    for m, (ls, alive) in enumerate(zip(st["learners"], st["alive"])):
        rate = 1.0 / ls["step_time_ema"] if ls.get("step_time_ema") else 0.0
        loss = f"{ls['loss']:.3f}" if ls.get("loss") is not None else "-"
        t.add_row(
            str(m), "up" if alive else "down", str(ls.get("steps", 0)), f"{rate:.1f}", loss, str(ls.get("applied", 0))
        )
    sy = st["syncer"]
    if sy:
        versions = list(sy.get("versions", {}).values())
        t.caption = (
            f"syncer: live {sy.get('live')}, min/max version {min(versions, default=0)}/{max(versions, default=0)}, "
            f"merged tokens {sy.get('global_tokens', 0):,.0f}, malformed {sy.get('malformed', 0)}"
        )
    return t


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddiloco", description="Decoupled DiLoCo: resilient, low-communication distributed pre-training."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser("simulate", help="train in deterministic virtual time (M learners in one process)")
    sim.add_argument("config", nargs="?", help="TOML config file (sections run, workload, algo, inner, sim, chaos)")
    sim.add_argument(
        "--method", choices=["dp", "diloco", "streaming", "decoupled"], help="method preset (default: decoupled)"
    )
    sim.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config value (repeatable)")
    sim.set_defaults(func=cmd_simulate)
    sy = sub.add_parser("syncer", help="run a syncer service (one shard)")
    sy.add_argument("config", nargs="?", help="TOML config (the same for syncer and learners)")
    sy.add_argument("--bind", required=True, help="ZeroMQ address to bind, e.g. tcp://0.0.0.0:5555")
    sy.add_argument(
        "--run-dir", required=True, help="durable state, tape and final model go here; restarting on it resumes"
    )
    sy.add_argument(
        "--shard", type=int, default=0, help="this shard's index (fragments p with p %% num_shards == shard)"
    )
    sy.add_argument("--num-shards", type=int, default=1, help="number of syncer shards")
    sy.add_argument("--method", choices=["diloco", "streaming", "decoupled"])
    sy.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE")
    _key_args(sy, "the syncer's key pair and every allowed public key (from `ddiloco keys`)")
    sy.set_defaults(func=cmd_syncer)
    le = sub.add_parser("learner", help="run one learner process")
    le.add_argument("config", nargs="?")
    le.add_argument(
        "--syncer", action="append", default=[], help="syncer shard address (repeat for each shard, in shard order)"
    )
    le.add_argument("--standalone", action="store_true", help="train without any syncer (the 'syncing off' reference)")
    le.add_argument(
        "--id", type=int, required=True, help="learner id (also picks the data shard: id mod run.num_learners)"
    )
    le.add_argument("--run-dir", default="runs/latest", help="where status files go")
    le.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto (cuda when available)")
    le.add_argument("--threads", type=int, default=0, help="torch threads (default: run.threads)")
    le.add_argument("--method", choices=["diloco", "streaming", "decoupled"])
    le.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE")
    _key_args(le, "syncer.key and this learner's learner-ID.key_secret (from `ddiloco keys`)")
    le.set_defaults(func=cmd_learner)
    ev = sub.add_parser("evaluator", help="evaluate the syncer's global model periodically (low priority)")
    ev.add_argument("config", nargs="?")
    ev.add_argument("--syncer", action="append", required=True)
    ev.add_argument("--run-dir", required=True)
    ev.add_argument("--method", choices=["diloco", "streaming", "decoupled"])
    ev.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE")
    _key_args(ev, "syncer.key and observer.key_secret (from `ddiloco keys`)")
    ev.set_defaults(func=cmd_evaluator)
    ks = sub.add_parser("keys", help="make CURVE key pairs for a syncer, its learners and an observer")
    ks.add_argument("dir", help="folder for the key files (existing pairs are kept)")
    ks.add_argument("--learners", type=int, required=True, help="learner ids 0 .. N-1 get a key pair each")
    ks.add_argument("--observers", type=int, default=1, help="read-only clients (evaluator, status)")
    ks.set_defaults(func=cmd_keys)
    tr = sub.add_parser("train", help="run a syncer, M learners and an evaluator as local processes")
    tr.add_argument("config", nargs="?")
    tr.add_argument("--method", choices=["diloco", "streaming", "decoupled"])
    tr.add_argument(
        "--chaos", action="store_true", help="turn on the [chaos] section (kills, stragglers, syncer kills)"
    )
    tr.add_argument("--run-dir", help="run folder (default: run.run_dir)")
    tr.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE")
    tr.set_defaults(func=cmd_train)
    rp = sub.add_parser("report", help="one self-contained HTML page (figures inline) about one or more run folders")
    rp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folder (format 2); several are overlaid")
    rp.add_argument(
        "-o", "--out", help="HTML file to write (default: RUN_DIR/report.html, or ./ddiloco-report.html for several)"
    )
    rp.set_defaults(func=cmd_report)
    gp = sub.add_parser("goodput", help="datacenter-scale goodput and bandwidth simulator", add_help=False)
    gp.add_argument("rest", nargs=argparse.REMAINDER)
    gp.set_defaults(func=lambda a: _goodput(a.rest))
    return parser


def _key_args(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--keys", metavar="DIR", help=f"CURVE keys: {what}; required off this machine")
    parser.add_argument(
        "--insecure", action="store_true", help="allow a non-loopback address without keys (prints a warning)"
    )


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


def _goodput(argv: list[str]) -> int:
    from ddiloco.goodput.cli import main as goodput_main

    return goodput_main(argv)


def setup_logging(level: int = logging.INFO) -> None:
    """Every process logs to stderr with a timestamp, its level and where the line comes from."""
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
        stream=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["goodput"]:  # its own parser owns every option after the word
        return _goodput(argv[1:])
    args = build_parser().parse_args(argv)
    setup_logging()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.formatwarning = lambda msg, *a, **k: f"warning: {msg}\n"
            return int(args.func(args) or 0)
    except DDiLoCoError as e:
        print(f"error: {e}", file=sys.stderr)  # the one line a user reads; no logger prefix
        return 2


if __name__ == "__main__":
    sys.exit(main())
