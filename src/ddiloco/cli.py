"""``ddiloco`` command line: simulate | goodput (more subcommands come with the real runtime)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import warnings
from pathlib import Path

from ddiloco.errors import DDiLoCoError
from ddiloco.lifecycle import EXIT_INTERRUPTED, ProgressLines, StopSignals


def cmd_simulate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from ddiloco.report.rundir import choose_run_dir, prepare_run_dir, write_run_dir
    from ddiloco.report.summary import print_summary
    from ddiloco.sim.run import simulate

    overrides = list(args.set or [])
    method = _method(args, overrides)
    if args.config is None and method != "dp":
        # The demo without a config file: failures plus one 2x straggler.
        overrides = ["chaos.enabled=true", 'chaos.stragglers=["1:2.0"]', *overrides]
    cfg = _load(args, overrides=overrides, runtime=False)
    run_dir, _ = choose_run_dir(cfg.run.run_dir, cfg.run.method, args.run_dir, None, can_resume=False)
    cfg = _with_run_dir(cfg, run_dir)
    prepare_run_dir(run_dir, "ddiloco simulate", cfg)  # refuse a foreign folder before any work
    stop = StopSignals("ddiloco simulate")
    console = Console(stderr=True)
    with (
        stop,
        Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.percentage:>3.0f}% of its budget"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
            disable=not console.is_terminal,
        ) as progress,
    ):
        task = progress.add_task(f"simulating {method}, M={cfg.run.num_learners}", total=1.0)
        lines = ProgressLines(cfg.runtime.progress_interval_s, enabled=not console.is_terminal)

        def on_progress(value: float, total: float, unit: str) -> None:
            done = min(1.0, value / total) if total > 0 else 1.0
            progress.update(task, completed=done)
            lines.maybe(lambda: f"simulate {method}: {done:.0%} of its budget ({value:,.0f} / {total:,.0f} {unit})")

        result = simulate(cfg, on_progress=on_progress, should_stop=lambda: stop.requested)
        out = write_run_dir(cfg.run.run_dir, cfg, result)
    summary = json.loads((out / "summary.json").read_text())
    print_summary(summary, f"ddiloco simulate --method {method}", out)
    return EXIT_INTERRUPTED if result.partial else 0


def _method(args: argparse.Namespace, overrides: list[str], default: str = "decoupled") -> str:
    """The method preset a command starts from: the last ``--set run.method=...`` wins over
    ``--method``, which wins over the config file's ``run.method``."""
    for o in reversed(overrides):
        if o.replace(" ", "").startswith("run.method="):
            return o.split("=", 1)[1].strip().strip("\"'")
    return getattr(args, "method", None) or _method_in(getattr(args, "config", None)) or default


def _method_in(path: str | None) -> str | None:
    if path:
        from ddiloco.config import tomllib

        try:
            with open(path, "rb") as f:
                return tomllib.load(f).get("run", {}).get("method")
        except (OSError, tomllib.TOMLDecodeError):
            return None  # load_config reports the problem with one clear line
    return None


def _load(
    args: argparse.Namespace,
    default_method: str = "decoupled",
    overrides: list[str] | None = None,
    runtime: bool = True,
):
    """Defaults <- the method's preset <- the config file <- ``--method`` <- ``--set``
    (``runtime``: only the methods the real runtime runs)."""
    from ddiloco.config import load_config
    from ddiloco.methods import PRESETS

    overrides = list(getattr(args, "set", None) or []) if overrides is None else overrides
    method = _method(args, overrides, default_method)
    if method not in PRESETS:
        raise DDiLoCoError(f"method {method!r} is not known; allowed: {', '.join(PRESETS)}")
    if runtime and method == "dp":
        raise DDiLoCoError(f"method {method!r} cannot run on the real runtime; use decoupled, diloco or streaming")
    return load_config(args.config, [f"run.method={method}", *overrides], base=PRESETS[method])


def _load_resumed(args: argparse.Namespace, run_dir: Path):
    """``--resume RUN_DIR``: the run's saved config, with only runtime overrides."""
    from ddiloco.config import load_config

    given = [flag for flag, on in (("CONFIG", args.config), ("--method", args.method), ("--chaos", args.chaos)) if on]
    if given:
        raise DDiLoCoError(f"--resume continues the run's saved config: drop {', '.join(given)}")
    overrides = list(args.set or [])
    for o in overrides:
        if not o.strip().startswith(("runtime.", "run.threads")):
            raise DDiLoCoError(
                f"--resume allows only runtime.* and run.threads overrides; --set {o} changes the run: start a new one"
            )
    path = run_dir / "config.toml"
    if not path.is_file():
        raise DDiLoCoError(f"--resume {args.resume}: the run folder has no config.toml to continue from")
    from ddiloco.report.rundir import MODEL_INFO

    if (run_dir / MODEL_INFO).is_file():  # its model came from code; workload.* would build another one
        raise DDiLoCoError(
            f"--resume {args.resume}: this run's model was built in Python (ddiloco.SyncerServer, see {MODEL_INFO}), "
            "which ddiloco train cannot rebuild: resume it with SyncerServer(model, BIND, RUN_DIR) and your learners"
        )
    return load_config(path, overrides)


def _with_run_dir(cfg, run_dir: Path):
    """``cfg`` with ``run.run_dir`` set to the folder the run actually uses."""
    import dataclasses

    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, run_dir=str(run_dir)))


def _check_run_dir(run_dir: str, cfg, by: str, create: bool = True) -> None:
    """Refuse a run folder of another format, or whose saved config differs, before the command
    writes anything into it (``create``: make it a run folder with ``cfg`` when it is not one)."""
    from ddiloco.report.rundir import is_run_dir, prepare_run_dir

    if create or is_run_dir(run_dir):
        prepare_run_dir(run_dir, by, cfg)


def cmd_syncer(args: argparse.Namespace) -> int:
    from ddiloco.service.syncer.service import open_syncer

    cfg = _load(args)
    _check_run_dir(args.run_dir, cfg, f"ddiloco syncer (shard {args.shard})")
    if args.start_over:
        from ddiloco.service.syncer.store import start_over

        start_over(args.run_dir, args.shard, args.num_shards)
    service, _ = open_syncer(
        cfg, args.bind, args.run_dir, shard=args.shard, num_shards=args.num_shards, keys_dir=args.keys,
        insecure=args.insecure,
    )  # fmt: skip
    # A signal stops it durably (the run is marked interrupted); started again on the folder, it resumes.
    with StopSignals(f"ddiloco syncer (shard {args.shard})", on_stop=service.stop):
        service.serve()
    if args.shard == 0:
        from ddiloco.report.summary import log_time_budget_short

        log_time_budget_short(args.run_dir)
    return 0


def cmd_learner(args: argparse.Namespace) -> int:
    from ddiloco.service.learner.process import run_learner

    cfg = _load(args)
    if not args.syncer and not args.standalone:
        raise DDiLoCoError(
            "ddiloco learner needs --syncer tcp://HOST:PORT (one per shard), or --standalone to train alone"
        )
    device = ("cuda" if _cuda() else "cpu") if args.device == "auto" else args.device
    threads = args.threads or cfg.run.threads
    _check_run_dir(args.run_dir, cfg, "ddiloco learner", create=False)
    return run_learner(cfg, args.syncer, args.id, args.run_dir, device, threads, args.keys, args.insecure)


def cmd_evaluator(args: argparse.Namespace) -> int:
    from ddiloco.service.base.keys import client_keys
    from ddiloco.service.ops.evaluator import run_evaluator

    cfg = _load(args)
    _check_run_dir(args.run_dir, cfg, "ddiloco evaluator")
    keys = client_keys(args.syncer, args.keys, "observer", args.insecure)
    return run_evaluator(cfg, args.syncer, args.run_dir, keys=keys)


def cmd_keys(args: argparse.Namespace) -> int:
    from ddiloco.service.base.keys import make_keys

    made = make_keys(args.dir, args.learners, args.observers)
    print(f"{len(made)} key pairs written to {args.dir} (existing ones kept). The syncer needs syncer.key_secret "
          "and every *.key; learner m needs syncer.key and learner-m.key_secret; see docs/security.md")  # fmt: skip
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    try:  # Ctrl-C ends --watch quietly, even while the first query (or importing torch) is under way
        from ddiloco.service.ops.status_cmd import run_status

        return run_status(args.target, args.watch, args.keys, args.insecure, args.json, args.timeout)
    except KeyboardInterrupt:
        return 0 if args.watch is not None else 130


def cmd_alive(args: argparse.Namespace) -> int:
    from ddiloco.service.ops.alive import check_alive

    alive, line = check_alive(args.run_dir, args.learner, args.within)
    print(line, file=sys.stdout if alive else sys.stderr)
    return 0 if alive else 1


def cmd_train(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    from ddiloco.report.rundir import choose_run_dir, prepare_run_dir
    from ddiloco.report.summary import print_summary
    from ddiloco.service.ops.launcher import Launcher, check_chaos_horizon

    options = _launcher_options(args)
    if args.resume:  # the folder first (one line if it is none), then its saved config
        run_dir, _resuming = choose_run_dir("", "", args.run_dir, args.resume)
        cfg = _load_resumed(args, run_dir)
        check_chaos_horizon(cfg)
    else:
        cfg = _load(args, overrides=["chaos.enabled=true", *(args.set or [])] if args.chaos else None)
        check_chaos_horizon(cfg)  # before a fresh folder is made
        run_dir, _resuming = choose_run_dir(cfg.run.run_dir, cfg.run.method, args.run_dir, None)
    cfg = _with_run_dir(cfg, run_dir)
    prepare_run_dir(run_dir, "ddiloco train", cfg)  # refuse a foreign folder or config before any work
    launcher = Launcher(cfg, run_dir, **options)
    console = Console(stderr=True)
    lines = ProgressLines(cfg.runtime.progress_interval_s, enabled=not console.is_terminal)
    with (
        StopSignals("ddiloco train", on_stop=launcher.request_stop),
        Live(console=console, refresh_per_second=2, transient=False, redirect_stdout=False) as live,
    ):
        if console.is_terminal:
            launcher.on_status = lambda st: live.update(progress_table(st))
        else:  # nohup, Slurm, a pipe: a line now and then instead of a live table
            launcher.on_status = lambda st: lines.maybe(lambda: progress_line(st))
        summary = launcher.run()
    title = f"ddiloco train --method {cfg.run.method} (real processes)"
    print_summary(summary, title, launcher.run_dir)
    return EXIT_INTERRUPTED if summary.get("partial") else 0


def progress_line(st: dict) -> str:
    """The live table in one line (for output that is not a terminal)."""
    sy = st["syncer"]
    up = sum(st["alive"])
    return (
        f"train: {_elapsed(st)}, {sy.get('processed_tokens', 0):,.0f} / {st['tokens_budget']:,} "
        f"tokens processed ({sy.get('merged_tokens', 0):,.0f} merged), {up}/{len(st['alive'])} learners up, "
        f"faults injected {st['faults']}" + (f", ending ({sy['run_end']})" if sy.get("run_end") else "")
    )


def _elapsed(st: dict) -> str:
    """Seconds since the start, over the time budget when the run has one."""
    import math

    T = st["T"]
    return f"{st['t']:.0f} / {T:.0f} s" if math.isfinite(T) else f"{st['t']:.0f} s (no time budget)"


def _launcher_options(args: argparse.Namespace) -> dict:
    """``--host``, ``--port``, ``--insecure`` and ``--start-over`` for the launcher."""
    if args.start_over and not args.resume:
        raise DDiLoCoError(
            "--start-over starts a run over whose syncer state is gone: use it with --resume RUN_DIR (a new run "
            "starts at version 0 anyway)"
        )
    return {"host": args.host, "port": args.port, "insecure": args.insecure, "start_over": args.start_over}


def cmd_link(args: argparse.Namespace) -> int:
    from ddiloco.link.command import plan_from_flags, read_plan, run_relays

    if args.plan:
        if args.listen or args.to or args.link or args.faults:
            raise DDiLoCoError("--plan FILE holds every route: drop --listen, --to, --link and --faults")
        plan = read_plan(args.plan)
    elif not (args.listen and args.to):
        raise DDiLoCoError("ddiloco link needs --listen HOST:PORT and --to HOST:PORT (or --plan FILE)")
    else:
        plan = plan_from_flags(args.listen, args.to, args.link or "", args.faults or [], args.site or "", args.seed,
                               args.horizon)  # fmt: skip
    run_relays(plan, args.faults_log, args.ready_file)
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """``ddiloco config``: every key with its type, default and docs, or a resolved config."""
    if args.list:
        from ddiloco.config_reference import format_reference, reference

        if args.config or args.set:
            raise DDiLoCoError("--list shows the defaults (of --method's preset); drop CONFIG and --set")
        sys.stdout.write(format_reference(reference(args.method)))
        return 0
    import tomli_w

    from ddiloco.config import to_dict

    sys.stdout.write(tomli_w.dumps(to_dict(_load(args, runtime=False))))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from ddiloco.export_cmd import run_export

    out = run_export(
        args.source, args.out, args.format, args.config, args.run_dir, args.keys, args.insecure, args.timeout
    )
    print(f"exported the global model to {out}")
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    from ddiloco.migrate_cmd import migrate

    done = migrate(args.run_dir)
    for line in done:
        print(line)
    print(f"{args.run_dir}: nothing to migrate" if not done else f"{args.run_dir}: migrated; it resumes as before")
    return 0


def cmd_tensorboard(args: argparse.Namespace) -> int:
    from ddiloco.report.tensorboard import export_scalars

    with StopSignals("ddiloco tensorboard") as stop:
        out, n = export_scalars(args.run_dir, args.logdir, args.follow, should_stop=lambda: stop.requested)
    print(f"{n:,} scalars written to {out} (view: tensorboard --logdir {out})")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from ddiloco.report.html import render_report
    from ddiloco.report.rundir import RUN_FORMAT
    from ddiloco.report.summary import run_info, write_summary

    for d in args.run_dirs:  # the figures come from the one summary function, also for a run cut short
        if run_info(d).get("format") == RUN_FORMAT:
            try:
                write_summary(d)
            except OSError as e:  # a read-only folder: its summary.json stands
                logging.getLogger(__name__).warning("could not refresh the summary of %s: %s", d, e)

    print(f"report: {render_report(args.run_dirs, args.out)}")
    return 0


def progress_table(st: dict):
    from rich.table import Table

    sy = st["syncer"]
    end = f", ending: {sy['run_end']}" if sy.get("run_end") else ""
    t = Table(
        title=f"ddiloco train: {_elapsed(st)}, {sy.get('processed_tokens', 0):,.0f} / "
        f"{st['tokens_budget']:,} tokens processed ({sy.get('merged_tokens', 0):,.0f} merged), faults injected: "
        f"{st['faults']}{end}"
    )
    for col in ("learner", "state", "steps", "steps/s", "train loss", "versions applied"):
        t.add_column(col, justify="right")
    for m, (ls, alive) in enumerate(zip(st["learners"], st["alive"])):
        rate = 1.0 / ls["step_time_s"] if ls.get("step_time_s") else 0.0
        loss = f"{ls['loss']:.3f}" if ls.get("loss") is not None else "-"
        t.add_row(
            str(m), "up" if alive else "down", str(ls.get("steps", 0)), f"{rate:.1f}", loss, str(ls.get("applied", 0))
        )
    if sy:
        versions = list(sy.get("versions", {}).values())
        t.caption = (
            f"syncer: live {len(sy.get('live', []))}, versions {min(versions, default=0)}..{max(versions, default=0)}, "
            f"malformed messages {sy.get('malformed', 0)}; terms: docs/operations.md#terms"
        )
    return t


RUNTIME_METHODS = ["diloco", "streaming", "decoupled"]


def build_parser() -> argparse.ArgumentParser:
    from ddiloco import __version__
    from ddiloco.cli_types import bind_address, connect_address, int_range, positive_seconds

    parser = argparse.ArgumentParser(
        prog="ddiloco", description="Decoupled DiLoCo: resilient, low-communication distributed pre-training."
    )
    parser.add_argument("--version", action="version", version=f"ddiloco {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sim = sub.add_parser("simulate", help="train in deterministic virtual time (M learners in one process)")
    _config_args(sim, ["dp", "diloco", "streaming", "decoupled"], "without one: the demo (chaos on)")
    _run_dir_args(sim, resume=False)
    sim.set_defaults(func=cmd_simulate)
    sy = sub.add_parser("syncer", help="run a syncer service (one shard)")
    _config_args(sy, RUNTIME_METHODS, "the same for the syncer and its learners")
    sy.add_argument(
        "--bind",
        required=True,
        type=bind_address,
        help="ZeroMQ address to bind: tcp://HOST:PORT (HOST may be *, every interface) or ipc://PATH",
    )
    sy.add_argument(
        "--run-dir",
        required=True,
        help="durable state, tape and final model go here; a syncer (re)started on an existing run folder resumes "
        "it, no flag needed (its saved config must match)",
    )
    sy.add_argument(
        "--shard", type=int_range(0), default=0, help="this shard's index (fragments p with p %% num_shards == shard)"
    )
    sy.add_argument("--num-shards", type=int_range(1), default=1, help="number of syncer shards (default: 1)")
    _start_over_arg(sy)
    _key_args(sy, "the syncer's key pair and every allowed public key (from `ddiloco keys`)")
    sy.set_defaults(func=cmd_syncer)
    le = sub.add_parser("learner", help="run one learner process")
    _config_args(le, RUNTIME_METHODS, "the syncer's")
    le.add_argument(
        "--syncer",
        action="append",
        default=[],
        type=connect_address,
        help="syncer shard address, tcp://HOST:PORT (repeat for each shard, in shard order)",
    )
    le.add_argument("--standalone", action="store_true", help="train without any syncer (the 'syncing off' reference)")
    le.add_argument(
        "--id",
        type=int_range(0, 65535),
        required=True,
        help="learner id, 0 .. run.num_learners - 1 (the syncer refuses others); it also picks the data shard",
    )
    le.add_argument("--run-dir", default="runs/latest", help="where status files go (default: runs/latest)")
    le.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto (cuda when available)")
    le.add_argument("--threads", type=int_range(0), default=0, help="torch threads (default 0: run.threads)")
    _key_args(le, "syncer.key and this learner's learner-ID.key_secret (from `ddiloco keys`)")
    le.set_defaults(func=cmd_learner)
    ev = sub.add_parser(
        "evaluator", help="evaluate the syncer's global model as tokens merge, fetching what changed (low priority)"
    )
    _config_args(ev, RUNTIME_METHODS, "the syncer's")
    ev.add_argument(
        "--syncer",
        action="append",
        required=True,
        type=connect_address,
        help="syncer shard address, tcp://HOST:PORT (repeat for each shard, in shard order)",
    )
    ev.add_argument("--run-dir", required=True, help="the run folder; evaluations go to its metrics/eval.jsonl")
    _key_args(ev, "syncer.key and observer.key_secret (from `ddiloco keys`)")
    ev.set_defaults(func=cmd_evaluator)
    ks = sub.add_parser("keys", help="make CURVE key pairs for a syncer, its learners and an observer")
    ks.add_argument("dir", help="folder for the key files (existing pairs are kept)")
    ks.add_argument(
        "--learners", type=int_range(1, 65536), required=True, help="learner ids 0 .. N-1 get a key pair each"
    )
    ks.add_argument("--observers", type=int_range(0), default=1, help="read-only clients (evaluator, status)")
    ks.set_defaults(func=cmd_keys)
    tr = sub.add_parser("train", help="run a syncer, M learners and an evaluator as local processes")
    _config_args(tr, RUNTIME_METHODS, "without one: the defaults")
    tr.add_argument(
        "--chaos", action="store_true", help="turn on the [chaos] section (kills, stragglers, syncer kills)"
    )
    _run_dir_args(tr, resume=True)
    tr.add_argument(
        "--host", default="127.0.0.1", help="address the local syncer binds and its processes use (default: 127.0.0.1)"
    )
    tr.add_argument("--port", type=int_range(1, 65535), help="the syncer's TCP port (default: a free one)")
    tr.add_argument(
        "--insecure",
        action="store_true",
        help="run without CURVE keys (default: the run's own keys in RUN_DIR/keys, also on loopback, so that no "
        "other local process can take a learner id or pose as the syncer)",
    )
    _start_over_arg(tr)
    tr.set_defaults(func=cmd_train)
    st = sub.add_parser("status", help="the fleet at a glance: learners and fragments, from a syncer or a run folder")
    st.add_argument(
        "target",
        nargs="+",
        metavar="ADDR|RUN_DIR",
        help="a live syncer's address tcp://HOST:PORT (one per shard), or a run folder (reads status/syncer-*.json)",
    )
    st.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until Ctrl-C",
    )
    st.add_argument("--json", action="store_true", help="print the status as JSON (one line per refresh with --watch)")
    st.add_argument(
        "--timeout", type=float, default=5.0, metavar="SECONDS", help="how long to wait for a syncer's answer"
    )
    _key_args(st, "syncer.key and observer.key_secret (from `ddiloco keys`)")
    st.set_defaults(func=cmd_status)
    al = sub.add_parser(
        "alive", help="exit 0 if a learner stepped within SECONDS (its status file is fresh), else 1: a liveness probe"
    )
    al.add_argument("run_dir", metavar="RUN_DIR", help="the learner's --run-dir (it writes status/learner-M.json)")
    al.add_argument(
        "--learner",
        type=int_range(0, 65535),
        metavar="M",
        help="the learner id (default: the one learner whose status file RUN_DIR holds)",
    )
    al.add_argument(
        "--within",
        type=positive_seconds,
        required=True,
        metavar="SECONDS",
        help="the oldest status file that still counts as alive; give it well above runtime.status_interval_s "
        "and a step's time",
    )
    al.set_defaults(func=cmd_alive)
    ln = sub.add_parser(
        "link", help="a TCP relay that emulates a thin link (rate, latency, stalls, resets, partitions) to a syncer"
    )
    ln.add_argument("--listen", metavar="HOST:PORT", help="where learners connect (port 0: any free one)")
    ln.add_argument("--to", metavar="HOST:PORT", help="the syncer (shard) every connection is forwarded to")
    ln.add_argument(
        "--link",
        metavar="SPEC",
        help="the link, e.g. '10mbit,50ms' or '2mbit,100ms,jitter=10ms,stall=0.01:200ms' "
        "(docs/runtime.md#link-emulator)",
    )
    ln.add_argument(
        "--faults",
        action="append",
        metavar="FAULT",
        help="hold:30s@120s, cut:30s@120s, reset_every:10s, reset_mean:10s or flap:10s/5s (repeatable; times count "
        "from the relay's start)",
    )
    ln.add_argument("--site", metavar="RATE", help="an aggregate cap per direction over every route, e.g. 100mbit")
    ln.add_argument("--horizon", type=float, metavar="SECONDS", help="the run's length, for fault times given in %%")
    ln.add_argument("--seed", type=int_range(0), default=0, help="seeds jitter, stalls and Poisson resets")
    ln.add_argument("--plan", metavar="FILE", help="several routes from a JSON plan (what ddiloco train writes)")
    ln.add_argument(
        "--faults-log", metavar="PATH", help="append each fault as a JSON line (RUN_DIR/metrics/faults.jsonl)"
    )
    ln.add_argument("--ready-file", metavar="PATH", help="write {pid, ports} here once every route listens")
    ln.set_defaults(func=cmd_link)
    cf = sub.add_parser("config", help="list every config key with its docs, or print a resolved config")
    _config_args(cf, ["dp", "diloco", "streaming", "decoupled"], "printed resolved, with --set applied")
    cf.add_argument(
        "--list",
        action="store_true",
        help="list every key (section.key), its type, default and docs; with --method, that preset's defaults",
    )
    cf.set_defaults(func=cmd_config)
    ex = sub.add_parser("export", help="write the global model of a run folder or a live syncer")
    ex.add_argument(
        "source",
        nargs="+",
        metavar="RUN_DIR|ADDR",
        help="a run folder (its final/ model), a .safetensors file, or a live syncer's tcp://HOST:PORT (one per "
        "shard, in shard order)",
    )
    ex.add_argument("-o", "--out", help="output file (safetensors) or folder (hf); default: named after the source")
    ex.add_argument(
        "--format",
        choices=["safetensors", "hf"],
        default="safetensors",
        help="safetensors: one plain state dict; hf: a from_pretrained folder (Hugging Face models only)",
    )
    ex.add_argument("--config", metavar="FILE", help="the run's config (needed for a live syncer or --format hf)")
    ex.add_argument("--run-dir", help="take the config from this run folder's config.toml")
    ex.add_argument(
        "--timeout", type=float, default=10.0, help="seconds to wait for a live syncer's answer (default: 10)"
    )
    _key_args(ex, "syncer.key and observer.key_secret (from `ddiloco keys`)")
    ex.set_defaults(func=cmd_export)
    rp = sub.add_parser("report", help="one self-contained HTML page (figures inline) about one or more run folders")
    rp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folder (format 2); several are overlaid")
    rp.add_argument(
        "-o", "--out", help="HTML file to write (default: RUN_DIR/report.html, or ./ddiloco-report.html for several)"
    )
    rp.set_defaults(func=cmd_report)
    mg = sub.add_parser("migrate", help="bring a run folder of the previous ddiloco to this one's formats, in place")
    mg.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (stop its syncer first)")
    mg.set_defaults(func=cmd_migrate)
    tb = sub.add_parser("tensorboard", help="a run's metrics as TensorBoard scalars (the optional tensorboard extra)")
    tb.add_argument("run_dir", metavar="RUN_DIR", help="the run folder whose metrics/*.jsonl to write")
    tb.add_argument("--logdir", help="where the event files go (default: RUN_DIR/tensorboard)")
    tb.add_argument("--follow", action="store_true", help="keep adding what the run appends until it ends (or Ctrl-C)")
    tb.set_defaults(func=cmd_tensorboard)
    gp = sub.add_parser("goodput", help="datacenter-scale goodput and bandwidth simulator", add_help=False)
    gp.add_argument("rest", nargs=argparse.REMAINDER, help="goodput's own options (see ddiloco goodput --help)")
    gp.set_defaults(func=lambda a: _goodput(a.rest))
    return parser


def _config_args(parser: argparse.ArgumentParser, methods: list[str], what: str) -> None:
    """The config file, ``--method`` and ``--set``, the same on every command that loads a config."""
    from ddiloco.cli_types import override

    parser.add_argument(
        "config",
        nargs="?",
        metavar="CONFIG.toml",
        help=f"TOML config file (sections run, workload, algo, inner, sim, chaos, runtime); {what}",
    )
    parser.add_argument(
        "--method",
        choices=methods,
        help="method preset the config applies to (default: the file's run.method, else decoupled); "
        "--set run.method=... wins over it",
    )
    parser.add_argument(
        "--set",
        action="append",
        type=override,
        metavar="SECTION.KEY=VALUE",
        help="override a config value (repeatable; wins over the file and --method); `ddiloco config --list` "
        "lists the keys",
    )


def _run_dir_args(parser: argparse.ArgumentParser, resume: bool) -> None:
    parser.add_argument(
        "--run-dir",
        metavar="DIR",
        help="run folder (default: a fresh runs/METHOD-YYYYmmdd-HHMMSS, with runs/latest pointing to it); "
        "one that already holds a run is refused",
    )
    if resume:
        parser.add_argument(
            "--resume",
            metavar="RUN_DIR",
            help="continue that run with its saved config (only runtime.* and run.threads may be --set)",
        )


def _start_over_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--start-over",
        action="store_true",
        help="the run folder's syncer state (RUN_DIR/state) is gone: start the run over from its initial model at "
        "version 0 instead of refusing (it never deletes state that is there)",
    )


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


@contextlib.contextmanager
def ddiloco_warnings():
    """ddiloco's own warnings (those raised from module ``ddiloco`` and below) are shown once each,
    as ``warning: MESSAGE``; every other warning keeps the filters and format already in force."""
    import ddiloco

    package = str(Path(ddiloco.__file__).parent)
    with warnings.catch_warnings():
        warnings.filterwarnings("once", module=r"ddiloco(\.|$)")
        show = warnings.showwarning

        def show_ours_plainly(message, category, filename, lineno, file=None, line=None):
            if str(filename).startswith(package):
                print(f"warning: {message}", file=file or sys.stderr)
            else:
                show(message, category, filename, lineno, file, line)

        warnings.showwarning = show_ours_plainly
        yield


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["goodput"]:  # its own parser owns every option after the word
        return _goodput(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "syncer" and args.shard >= args.num_shards:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices["syncer"].error(
            f"--shard {args.shard} is out of range; allowed: 0 .. --num-shards - 1 ({args.num_shards - 1})"
        )
    setup_logging()
    try:
        with ddiloco_warnings():
            return int(args.func(args) or 0)
    except DDiLoCoError as e:
        print(f"error: {e}", file=sys.stderr)  # the one line a user reads; no logger prefix
        return 2


if __name__ == "__main__":
    sys.exit(main())
