"""``ddiloco goodput``: the goodput grid, ``bandwidth`` and ``calibrate`` subcommands.

ddiloco goodput [grid options]           goodput/uptime table over fleet sizes and strategies
ddiloco goodput --bands [--valley PATH]  ... and the prediction bands over the consistent set
ddiloco goodput bandwidth [options]      cross-site bandwidth per training method
ddiloco goodput calibrate [options]      least-squares fit to the paper's DP rows
ddiloco goodput target [options]         a target run's goodput under learner losses, and the
                                         local run that stands for it (--local-params)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict

from ddiloco.chaos import parse_distribution, parse_duration
from ddiloco.core.compress import sparse
from ddiloco.errors import ConfigError
from ddiloco.goodput.bandwidth import (
    BITS_PER_VALUE,
    BandwidthConfig,
    bits_per_value,
    required_bandwidth,
    traffic_per_step,
)
from ddiloco.goodput.calibrate import (
    PAPER_DDILOCO,
    PAPER_DP,
    PAPER_ELASTIC,
    calibrate,
    models_from,
)
from ddiloco.goodput.config import (
    CALIBRATED,
    CostModel,
    FailureModel,
    SimConfig,
    Strategy,
)
from ddiloco.goodput.simulate import (
    DEFAULT_LEARNERS,
    PAPER_CHIPS,
    simulate_grid,
)
from ddiloco.goodput.target import LossCosts, Target, equivalent, long_run_goodput, predict
from ddiloco.goodput.valley import band_strategies

SUBCOMMANDS = ("grid", "bandwidth", "calibrate", "target")
_SUFFIX = {"": 1, "k": 1_000, "m": 1_000_000}


def parse_count(text: str, field: str) -> int:
    """``150k``, ``1.2M``, ``2400000`` -> int; ConfigError naming ``field`` otherwise."""
    m = re.fullmatch(r"\s*([-+]?[0-9.]+(?:e[0-9]+)?)\s*([kKmM]?)\s*", text)
    if m is None:
        raise ConfigError(f"{field} = {text!r}: expected a count such as 150000, 150k or 1.2M")
    value = float(m.group(1)) * _SUFFIX[m.group(2).lower()]
    if value != int(value) or value < 1:
        raise ConfigError(f"{field} = {text!r}: must be an integer >= 1")
    return int(value)


def parse_list(text: str, field: str) -> list[int]:
    return [parse_count(x, field) for x in text.split(",") if x.strip()]


def _add_model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("failure model (defaults: the documented calibration)")
    g.add_argument("--mtbi", default="1y", help="mean time between interruptions per chip")
    g.add_argument("--slice-chips", default=None, help="chips per slice (default 256)")
    g.add_argument("--repair", default=None, help="slice repair time, e.g. exponential:2h")
    g.add_argument("--restart", default=None, help="non-elastic restart time distribution")
    g.add_argument("--downscale", default=None, help="elastic downscale pause distribution")
    g.add_argument("--upscale", default=None, help="elastic upscale pause distribution")
    g.add_argument("--step", default=None, help="step time (lost on failure), e.g. 2s")
    g.add_argument("--checkpoint", default=None, help="non-elastic checkpoint interval")
    g.add_argument("--speed-cv", type=float, default=0.0, help="per-chip speed variance (cv)")
    s = p.add_argument_group("simulation")
    s.add_argument("--seeds", type=int, default=20, help="seeds per cell (CI over seeds)")
    s.add_argument("--seed", type=int, default=0, help="first seed")
    s.add_argument("--measure-repairs", type=float, default=20.0, help="measured window in mean repair times")
    s.add_argument("--warmup-repairs", type=float, default=5.0, help="discarded warm-up in mean repair times")


def models_from_args(a: argparse.Namespace) -> tuple[FailureModel, CostModel, SimConfig]:
    """Failure, cost and simulation configs from CLI options over the calibrated defaults."""
    failure, costs = models_from(CALIBRATED)
    f_kw: dict = {"mtbi_s": parse_duration(a.mtbi, "mtbi"), "speed_cv": a.speed_cv}
    if a.slice_chips is not None:
        f_kw["slice_chips"] = parse_count(a.slice_chips, "slice_chips")
    if a.repair is not None:
        f_kw["repair"] = parse_distribution(a.repair, "repair")
    c_kw: dict = {}
    for name in ("restart", "downscale", "upscale"):
        if getattr(a, name) is not None:
            c_kw[name] = parse_distribution(getattr(a, name), name)
    if a.step is not None:
        c_kw["step_s"] = parse_duration(a.step, "step")
    if a.checkpoint is not None:
        c_kw["checkpoint_s"] = parse_duration(a.checkpoint, "checkpoint")
    failure = FailureModel(**{**_fields(failure), **f_kw})
    costs = CostModel(**{**_fields(costs), **c_kw})
    sim = SimConfig(seeds=a.seeds, seed=a.seed, measure_repairs=a.measure_repairs, warmup_repairs=a.warmup_repairs)
    return failure, costs, sim


def _fields(obj: object) -> dict:
    return {k: getattr(obj, k) for k in obj.__dataclass_fields__}  # type: ignore[attr-defined]


def config_json(failure: FailureModel, costs: CostModel, sim: SimConfig) -> dict:
    """The configs, with distributions written as parseable strings."""
    return {
        "failure": {
            "mtbi_s": failure.mtbi_s,
            "slice_chips": failure.slice_chips,
            "repair": failure.repair.spec(),
            "speed_cv": failure.speed_cv,
        },
        "costs": {
            "restart": costs.restart.spec(),
            "downscale": costs.downscale.spec(),
            "upscale": costs.upscale.spec(),
            "step_s": costs.step_s,
            "checkpoint_s": costs.checkpoint_s,
        },
        "sim": asdict(sim),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddiloco goodput", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command")
    g = sub.add_parser("grid", help="goodput and uptime over fleet sizes (the default)")
    g.add_argument("--chips", default=",".join(str(n) for n in PAPER_CHIPS), help="fleet sizes, e.g. 150k,300k,1.2M")
    g.add_argument("--learners", default=",".join(map(str, DEFAULT_LEARNERS)), help="Decoupled DiLoCo learner counts M")
    g.add_argument("--quorum", type=int, default=1, help="quorum K (capped at M; paper: 1)")
    g.add_argument("--json", action="store_true", help="print JSON instead of a table")
    g.add_argument("--plot", metavar="PATH", help="write a PNG of goodput vs chips")
    g.add_argument(
        "--bands",
        action="store_true",
        help="also print each cell's median and 90%% band over the parameter sets "
        "consistent with the paper's DP rows (adds K = M/2 cells)",
    )
    g.add_argument(
        "--valley",
        metavar="PATH",
        help="valley map for --bands: docs/results/goodput.json or a saved map "
        "(default: map the valley now, minutes)",
    )
    g.add_argument("--tolerance", type=float, default=1.5, help="--bands: model error in points (sd) of the likelihood")
    g.add_argument("--workers", type=int, default=1, help="--bands without --valley: worker processes for the mapping")
    _add_model_options(g)

    b = sub.add_parser("bandwidth", help="cross-site bandwidth per training method")
    d = BandwidthConfig()
    b.add_argument("--params", default=f"{d.params:g}", help="model parameters, e.g. 5e9")
    b.add_argument("--step-time", default=f"{d.step_s}s", help="inner step time")
    b.add_argument("--sites", type=int, default=d.sites, help="sites / learners")
    b.add_argument("--fragments", "-P", type=int, default=d.fragments, help="fragments P")
    b.add_argument("--sync-every", "-H", type=int, default=d.sync_every, help="H")
    b.add_argument("--overlap", "--tau", type=int, default=d.overlap, help="tau (steps)")
    b.add_argument("--encoding", default=d.encoding, help=f"one of {', '.join(BITS_PER_VALUE)}")
    b.add_argument("--dp-encoding", default=d.dp_encoding, choices=list(BITS_PER_VALUE))
    b.add_argument("--down-encoding", default=None,
                   help="encoding of the merged versions the syncer sends (default: --encoding)")  # fmt: skip
    b.add_argument("--density", type=float, default=1.0,
                   help="algo.up_density: share of values a contribution sends (top-k, with positions)")  # fmt: skip
    b.add_argument("--down-density", type=float, default=None,
                   help="algo.down_density (default: --density)")  # fmt: skip
    b.add_argument("--tensors", type=int, default=0, help="tensors in the model (their header specs)")
    b.add_argument("--heartbeat", default="0.5s", help="runtime.heartbeat_interval_s (heartbeat overhead)")
    b.add_argument("--shards", type=int, default=1, help="syncer shards (each exchanges heartbeats)")
    b.add_argument("--json", action="store_true", help="print JSON instead of a table")

    c = sub.add_parser("calibrate", help="fit the model to the paper's data-parallel rows")
    c.add_argument("--fit-seeds", type=int, default=4, help="seeds per cell in the objective")
    c.add_argument("--check-seeds", type=int, default=20, help="seeds for the residuals")
    c.add_argument("--max-evals", type=int, default=250, help="objective evaluations")
    c.add_argument("--json", action="store_true", help="print JSON instead of a table")
    t = sub.add_parser("target", help="a target run's goodput under learner losses; its local equivalent")
    dt, dc = Target(), LossCosts()
    t.add_argument("--params", default=f"{dt.params:g}", help="the target's parameters, e.g. 7e9")
    t.add_argument("--step-time", default=f"{dt.step_s:g}s", help="its inner step time")
    t.add_argument("--learners", type=int, default=dt.learners, help="its learners M")
    t.add_argument("--loss-every", default=f"{dt.loss_every_s:g}s", help="one learner lost per this long, fleet-wide")
    t.add_argument("--link", default="1gbit", help="each learner's link, e.g. 1gbit or 10gbit")
    t.add_argument("--horizon", default="0s", help="the run's length from the first step (0: a long run's mean)")
    t.add_argument("--restart-delay", default=f"{dc.restart_delay_s:g}s", help="a lost learner's wait to start again")
    t.add_argument("--startup", default=f"{dc.startup_s:g}s", help="its start-up before it can fetch")
    t.add_argument("--restart-moves", type=float, default=dc.restart_moves_n,
                   help="what a restart with its save fetches before its first step, over N")  # fmt: skip
    t.add_argument("--replace-moves", type=float, default=dc.replace_moves_n,
                   help="what a replacement without state fetches before its first step, over N")  # fmt: skip
    t.add_argument("--local-params", type=float, default=0.0, help="a local model's parameters: its equivalent run")
    t.add_argument("--local-step-time", default="0.25s", help="the local model's inner step time")
    t.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ddiloco goodput``; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or (args[0] not in SUBCOMMANDS and args[0] not in ("-h", "--help")):
        args.insert(0, "grid")  # the grid is the default subcommand
    try:
        a = build_parser().parse_args(args)
        if a.command == "bandwidth":
            return _bandwidth(a)
        if a.command == "calibrate":
            return _calibrate(a)
        if a.command == "grid":
            return _grid(a)
        if a.command == "target":
            return _target(a)
        build_parser().print_help()
        return 0
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _grid(a: argparse.Namespace) -> int:
    from ddiloco.goodput.report import grid_rows, print_table

    failure, costs, sim = models_from_args(a)
    chips = parse_list(a.chips, "chips")
    learners = parse_list(a.learners, "learners")
    if a.quorum < 1:
        raise ConfigError(f"quorum (K) = {a.quorum}: must be an integer >= 1")
    for m in learners:
        if a.quorum > m:
            raise ConfigError(f"quorum (K) = {a.quorum}: must be in [1, M = {m}]")
    strategies = [Strategy("dp"), Strategy("elastic")] + [Strategy("decoupled", m, a.quorum) for m in learners]
    if a.bands:
        strategies = list(dict.fromkeys(strategies + band_strategies(learners)))
    band_set = _band_set(a) if a.bands else None
    t0 = time.perf_counter()
    cells = simulate_grid(chips, strategies, failure, costs, sim)
    seconds = time.perf_counter() - t0
    if a.plot:
        from ddiloco.goodput.plot import plot_goodput

        paper = {
            "DP": PAPER_DP,
            "elastic DP": PAPER_ELASTIC,
            "DDiLoCo M=8": {n: v for (m, n), v in PAPER_DDILOCO.items() if m == 8},
        }
        plot_goodput(cells, a.plot, paper=paper)
    if a.json:
        out = {"config": config_json(failure, costs, sim), "seconds": seconds, "cells": [c.to_json() for c in cells]}
        if band_set is not None:
            out["bands"] = band_set
        print(json.dumps(out, indent=2))
        return 0
    for metric in ("goodput", "uptime"):
        header, rows = grid_rows(cells, metric)
        print_table(
            f"{metric} % (mean ± 95% CI over {sim.seeds} seeds, MTBI " f"{failure.mtbi_s / 86400 / 365.25:g} y)",
            header,
            rows,
        )
    print(f"{len(cells)} cells x {sim.seeds} seeds in {seconds:.2f} s")
    if band_set is not None:
        from ddiloco.goodput.bands import Band
        from ddiloco.goodput.report import band_rows

        b = {(x["strategy"], x["chips"]): Band(x["median"], x["lo"], x["hi"]) for x in band_set["cells"]}
        cs = band_set["consistent_set"]
        print_table(
            f"goodput %: the model above, mean ± 95% CI over seeds · median "
            f"[90% band] over the {cs['size']} consistent parameter sets (tolerance "
            f"{cs['tolerance']:g} points)",
            *band_rows(b, cells),
        )
        for name, v in cs["spread"].items():
            print(
                f"  {name}: median {v['median']:.4g}, range [{v['min']:.4g}, {v['max']:.4g}]"
                + (" (reaches the prior box's edge)" if v["at_lower_edge"] or v["at_upper_edge"] else "")
            )
    return 0


def _band_set(a: argparse.Namespace) -> dict:
    """Bands (JSON-ready) of the valley map named by --valley, or of one mapped now."""
    from ddiloco.goodput.bands import bands, consistent_set, spread
    from ddiloco.goodput.valley import ValleyConfig, load_map, map_valley

    if not (a.tolerance >= 0):
        raise ConfigError(f"tolerance = {a.tolerance}: must be >= 0 (points)")
    if a.valley:
        try:
            vm = load_map(a.valley)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"valley = {a.valley!r}: not a readable valley map ({exc})") from None
    else:
        vm = map_valley(ValleyConfig(max_tolerance=max(a.tolerance, 2.0)), workers=a.workers)
    if a.tolerance > vm.config.max_tolerance:
        raise ConfigError(
            f"tolerance = {a.tolerance:g}: must be <= {vm.config.max_tolerance:g}, "
            f"the largest the valley map was made for"
        )
    cs = consistent_set(vm, a.tolerance)
    return {
        "consistent_set": {
            "tolerance": a.tolerance,
            "mass": cs.mass,
            "size": cs.size,
            "grid_points": cs.grid_points,
            "spread": spread(vm, cs),
        },
        "cells": [{"strategy": name, "chips": n, **b.to_json()} for (name, n), b in bands(vm, cs).items()],
    }


def _payload(encoding: str, density: float, field: str) -> str:
    """The payload encoding that ``encoding`` at ``density`` names (as ``algo.*_payload``)."""
    if not (0 < density <= 1):
        raise ConfigError(f"{field} = {density!r}: must be in (0, 1] (the share of values sent)")
    bits_per_value(encoding)
    return sparse(encoding, density)


def _bandwidth(a: argparse.Namespace) -> int:
    from ddiloco.goodput.report import bandwidth_rows, bandwidth_title, print_table, step_rows

    try:
        params = float(a.params)
    except ValueError:
        raise ConfigError(f"params = {a.params!r}: expected a number such as 5e9") from None
    cfg = BandwidthConfig(
        params=params,
        step_s=parse_duration(a.step_time, "step_time"),
        sites=a.sites,
        fragments=a.fragments,
        sync_every=a.sync_every,
        overlap=a.overlap,
        encoding=_payload(a.encoding, a.density, "density"),
        dp_encoding=a.dp_encoding,
    )
    down = _payload(a.down_encoding or a.encoding, a.density if a.down_density is None else a.down_density,
                    "down_density")  # fmt: skip
    reqs = required_bandwidth(cfg)
    step = traffic_per_step(
        round(params), cfg.fragments, cfg.sync_every, cfg.sites, cfg.encoding, down,
        tensors=a.tensors, step_s=cfg.step_s, heartbeat_interval_s=parse_duration(a.heartbeat, "heartbeat"),
        shards=a.shards,
    )  # fmt: skip
    if a.json:
        methods = [r.to_json() for r in reqs]
        print(json.dumps({"config": asdict(cfg), "methods": methods, "per_step": step.to_json()}, indent=2))
        return 0
    print_table(bandwidth_title(cfg), *bandwidth_rows(reqs))
    print_table(
        "Decoupled DiLoCo steady state, bytes per learner per inner step (one learner's link; "
        "data-parallel: fp32 ring all-reduce)",
        *step_rows(step),
    )
    return 0


def _calibrate(a: argparse.Namespace) -> int:
    from ddiloco.goodput.report import calibration_rows, print_table

    for name in ("fit_seeds", "check_seeds", "max_evals"):
        if getattr(a, name) < 1:
            raise ConfigError(f"{name} = {getattr(a, name)}: must be >= 1")
    cal = calibrate(fit_seeds=a.fit_seeds, check_seeds=a.check_seeds, max_evals=a.max_evals)
    if a.json:
        print(
            json.dumps(
                {
                    "params": cal.params,
                    "sse": cal.sse,
                    "evals": cal.evals,
                    "seconds": cal.seconds,
                    "within_3_points": cal.within3,
                    "max_abs_residual": cal.max_abs,
                    "residuals": [{**asdict(r), "residual": r.residual} for r in cal.residuals],
                },
                indent=2,
            )
        )
        return 0
    print_table(f"calibration: {cal.params}", *calibration_rows(cal))
    print(
        f"{cal.within3}/10 cells within 3 points, max |residual| {cal.max_abs:.1f}; "
        f"{cal.evals} evaluations in {cal.seconds:.1f} s"
    )
    return 0


def _target(a: argparse.Namespace) -> int:
    from ddiloco.goodput.report import print_table
    from ddiloco.link.config import parse_rate

    try:
        params = float(a.params)
    except ValueError:
        raise ConfigError(f"params = {a.params!r}: expected a number such as 7e9") from None
    step_s, loss_every_s = parse_duration(a.step_time, "step_time"), parse_duration(a.loss_every, "loss_every")
    target = Target(params, step_s, a.learners, loss_every_s, parse_rate(a.link, "link"))
    costs = LossCosts(restart_delay_s=parse_duration(a.restart_delay, "restart_delay"),
                      startup_s=parse_duration(a.startup, "startup"), restart_moves_n=a.restart_moves,
                      replace_moves_n=a.replace_moves)  # fmt: skip
    horizon = parse_duration(a.horizon, "horizon")
    out: dict = {"target": asdict(target), "costs": asdict(costs), "transfer_steps": target.transfer_steps(),
                 "long_run_goodput": long_run_goodput(target, costs)}  # fmt: skip
    if horizon > 0:
        out["horizon_s"] = horizon
        out["prediction"] = asdict(predict(target, costs, horizon))
    if a.local_params > 0:
        eq = equivalent(target, a.local_params, parse_duration(a.local_step_time, "local_step_time"))
        out["local"] = {"params": eq.local_params, "step_s": eq.local_step_s, "k": eq.k, "link_bps": eq.link_bps,
                        "loss_every_s": eq.loss_every_s}  # fmt: skip
    if a.json:
        print(json.dumps(out, indent=2))
        return 0
    rows = [
        ("model (fp32)", f"{target.model_bytes / 1e9:,.1f} GB"),
        ("one model over one link", f"{target.transfer_steps():,.1f} inner steps"),
        ("restart (its save) costs", f"{costs.of('restart', target):,.0f} learner-s"),
        ("replacement (no state) costs", f"{costs.of('replace', target):,.0f} learner-s"),
        ("goodput, a long run", f"{out['long_run_goodput']:.1%}"),
    ]
    if "prediction" in out:
        p = out["prediction"]
        rows += [(f"goodput over {horizon:,.0f} s from the first step", f"{p['goodput']:.1%}"),
                 ("... with the first join counted", f"{p['goodput_with_first_join']:.1%}")]  # fmt: skip
    if "local" in out:
        lo = out["local"]
        rows += [("local: target seconds per local second (k)", f"{lo['k']:g}"),
                 ("local: link rate", f"{lo['link_bps'] / 1e6:,.2f} Mbit/s"),
                 ("local: one learner lost per", f"{lo['loss_every_s']:,.1f} s")]  # fmt: skip
    print_table(f"{params:g} parameters, {target.learners} learners, {target.step_s:g} s a step, "
                f"{target.link_bps / 1e9:g} Gbit/s each, one learner lost per {target.loss_every_s:g} s",
                ("figure", "value"), rows)  # fmt: skip
    return 0
