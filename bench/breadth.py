"""Quality parity, widened (issue 22): the overlap rules, more seeds, vision, MoE, chaos and M = 8.

    python bench/breadth.py                  # every phase, in priority order (resumes)
    python bench/breadth.py --phases A,B     # some phases only
    python bench/breadth.py --report         # the report from cached runs only (no training)

The regime, the runner, the cache and the statistics are ``bench/quality.py``'s (same dense
GPT, same 4.1M tokens, same seeds paired with data-parallel, same 95% t-intervals); runs are
cached in bench/cache/breadth/ keyed on their settings and the code digest. Phases, in the
order the compute goes (an interrupted benchmark keeps what it finished):

A. The overlap rules (``algo.on_merged``: overwrite, shift, eager) at H = 6, 12, 24, seed 0, at
   the settings quality.py chose for Decoupled DiLoCo (inner LR 4e-3, outer 0.5 / 0.9), the
   synchronous DiLoCo control at H = 24 with the same settings, and DP. Also the vision DP LR
   brackets and the MoE DP run, which need no choice.
B. Seeds 0-2 of DP and of the chosen (rule, H) of A.
C. Vision: Decoupled DiLoCo (the chosen rule, H = 24) on the BatchNorm CNN and the MLP-Mixer,
   inner LR at a half and a quarter of DP's best (seed 0), then seed 1 of both arms.
D. MoE GPT (4 experts, top-2): DP and Decoupled DiLoCo (the chosen rule and H), seeds 0-1.
E. Chaos (each learner down 10%) with the chosen rule, seeds 0-2, judged at its token count.
F. Seeds 3-4 of B and of E (five in all).
G. Synchronous DiLoCo at its quality.py settings (H = 12), seeds 0-4, as the baseline.
H. M = 8 at 8.2M tokens (the regime's bound: 1,000 steps per learner, 41 outer steps at H = 24
   at 4.1M), DP and Decoupled DiLoCo with the chosen rule, seed 0.

What is cut when the compute runs out is said in the report (arms with no runs).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import quality as q  # noqa: E402  (the sibling benchmark: regime, runner, statistics)

ROOT = q.ROOT
SEEDS5 = (0, 1, 2, 3, 4)
RULES = ("overwrite", "shift", "eager")
BASE = [*q.COMMON, f"run.num_learners={q.M}", f"run.processed_tokens={q.TOKENS}"]
DP = ["inner.lr=0.0113137"]
"""quality.py's swept settings (docs/results/quality.json, "best")."""
DEC = ["inner.lr=0.004", "algo.outer_lr=0.5", "algo.outer_momentum=0.9"]
DIL = ["algo.sync_every=12", "inner.lr=0.008", "algo.outer_lr=0.5", "algo.outer_momentum=0.8"]

VISION_EXAMPLES = 204_800
"""Examples processed per vision run: 1,600 steps of 4 learners at batch 32 (~3.4 epochs)."""
VISION = [
    "workload.factory=ddiloco.workloads.vision:make_workload",
    "workload.batch_size=32",
    "workload.eval_windows=2000",
    "run.eval_points=8",
    f"run.num_learners={q.M}",
    f"run.processed_tokens={VISION_EXAMPLES}",
]
VISION_MODELS = {"cnn": "workload.options={model = 'cnn'}", "mixer": "workload.options={model = 'mixer'}"}
VISION_LRS = (1.5e-3, 3e-3, 6e-3)
VISION_SEEDS = (0, 1)
MOE_SEEDS = (0, 1)
"""Two seeds each: what 4 hours on 2 cores leave after the overlap rules and the dense seeds."""
RULE_NOISE = 0.005
"""A rule replaces overwrite only if it beats it by more than this at seed 0 (seed to seed,
the paired ratios of one arm spread by about 1%; DP's own loss moves 0.3% between machines)."""
MOE = ["workload.factory=ddiloco.workloads.moe:make_workload", "workload.options={experts = 4, top_k = 2}"]

Job = q.Job


def job(label: str, method: str, over: list[str], seed: int) -> Job:
    return (f"{label} seed {seed}", method, (*over, f"run.seed={seed}"))


def overlap_arm(rule: str, h: int) -> list[str]:
    return [*BASE, *DEC, f"algo.sync_every={h}", f"algo.on_merged={rule}"]


def vision_arm(model: str, method: str, lr: float) -> list[str]:
    return [*VISION, VISION_MODELS[model], f"inner.lr={lr:g}"]


class Bench:
    """The phases as job lists; ``results`` maps a job label to its run (cached or trained)."""

    def __init__(self, runner: q.Runner, train: bool) -> None:
        self.runner, self.train = runner, train
        self.results: dict[str, dict[str, Any]] = {}
        self.arms: dict[str, list[str]] = {}  # arm -> its job labels
        self.settings: dict[str, Any] = {}
        self.vision_lrs = list(VISION_LRS)

    def run(self, jobs: list[tuple[str, Job]]) -> None:
        """Run (or, with --report, look up) ``jobs``: (arm, job) pairs."""
        todo = [j for _, j in jobs if j[0] not in self.results]
        if self.train:
            for j in todo:
                self.runner.submit(j)
        for arm, j in jobs:
            self.arms.setdefault(arm, [])
            if j[0] not in self.arms[arm]:
                self.arms[arm].append(j[0])
        pending = [j for _, j in jobs if j[0] not in self.results]
        while pending:
            # Each run is cached as soon as it ends, not in job order: an interrupted benchmark
            # keeps every finished run.
            done = [j for j in pending if not self.train or self.runner.ready(j)]
            if not done:
                time.sleep(1.0)
                continue
            for j in done:
                pending.remove(j)
                hit = self.runner.result(j) if self.train else self.runner.cached(j[1], j[2])
                if hit is not None:
                    self.runner.used[self.runner.key(j[1], j[2])] = hit
                    self.results[j[0]] = hit

    def loss(self, label: str) -> float:
        r = self.results.get(label)
        return float(r["eval_loss"]) if r else float("inf")

    def best_rule(self) -> tuple[str, int]:
        """The (rule, H) of phase A's lowest seed-0 loss, unless overwrite (the default, which
        holds nothing extra) at its best H is within RULE_NOISE of it: one seed cannot tell
        rules apart by less (overwrite at H = 24 without A)."""
        tried = [(self.loss(f"decoupled {r} H={h} seed 0"), r, h) for r in RULES for h in q.H_GRID]
        loss, rule, h = min(tried)
        if loss == float("inf"):
            return "overwrite", 24
        plain = min(t for t in tried if t[1] == "overwrite")
        return (plain[1], plain[2]) if plain[0] <= loss * (1 + RULE_NOISE) else (rule, h)

    # -- phases ------------------------------------------------------------------------------

    def phase_a(self) -> None:
        jobs = [("dp", job("dp", "dp", [*BASE, *DP], 0))]
        for h in (24, 12, 6):
            jobs += [
                (f"decoupled {r} H={h}", job(f"decoupled {r} H={h}", "decoupled", overlap_arm(r, h), 0)) for r in RULES
            ]
        jobs.append(
            ("diloco H=24 (control)", job("diloco H=24 (control)", "diloco", [*BASE, *DEC, "algo.sync_every=24"], 0))
        )
        for model in VISION_MODELS:
            for lr in VISION_LRS:
                arm = f"vision {model} dp lr {lr:g}"
                jobs.append((arm, job(arm, "dp", vision_arm(model, "dp", lr), 0)))
        jobs.append(("moe dp", job("moe dp", "dp", [*BASE, *DP, *MOE], 0)))
        self.run(jobs)

    def dense_seeds(self, seeds: tuple[int, ...]) -> list[tuple[str, Job]]:
        rule, h = self.best_rule()
        self.settings["best"] = {"on_merged": rule, "sync_every": h}
        arm = f"decoupled {rule} H={h}"
        jobs = [("dp", job("dp", "dp", [*BASE, *DP], s)) for s in seeds]
        return jobs + [(arm, job(arm, "decoupled", overlap_arm(rule, h), s)) for s in seeds]

    def phase_b(self) -> None:
        self.run(self.dense_seeds(SEEDS5[:3]))

    def vision_dp_lr(self, model: str) -> float:
        tried = [lr for lr in self.vision_lrs if self.loss(f"vision {model} dp lr {lr:g} seed 0") < float("inf")]
        return min(tried or VISION_LRS, key=lambda lr: self.loss(f"vision {model} dp lr {lr:g} seed 0"))

    def extend_vision_dp(self) -> None:
        """A best DP LR at the edge of the bracket extends it that way (up to two doublings)."""
        for _ in range(2):
            jobs = []
            for model in VISION_MODELS:
                best = self.vision_dp_lr(model)
                edge = max(self.vision_lrs) if best == max(self.vision_lrs) else None
                if edge is not None and 2 * edge not in self.vision_lrs:
                    arm = f"vision {model} dp lr {2 * edge:g}"
                    jobs.append((arm, job(arm, "dp", vision_arm(model, "dp", 2 * edge), 0), 2 * edge))
            if not jobs:
                return
            self.vision_lrs += [lr for _, _, lr in jobs if lr not in self.vision_lrs]
            self.run([(a, j) for a, j, _ in jobs])

    def phase_c(self) -> None:
        rule, _ = self.best_rule()
        self.extend_vision_dp()
        best_lr: dict[str, float] = {}
        for model in VISION_MODELS:
            lr_dp = self.vision_dp_lr(model)
            tried = (lr_dp / 4, lr_dp / 2)  # the dense learners wanted about a third of DP's LR
            arms = [(f"vision {model} decoupled lr {lr:g}", lr) for lr in tried]
            self.run(
                [
                    (a, job(a, "decoupled", [*vision_arm(model, "decoupled", lr), f"algo.on_merged={rule}"], 0))
                    for a, lr in arms
                ]
            )
            best_lr[model] = min(tried, key=lambda lr: self.loss(f"vision {model} decoupled lr {lr:g} seed 0"))
        self.settings["vision_lr"] = {m: {"dp": self.vision_dp_lr(m), "decoupled": best_lr[m]} for m in VISION_MODELS}
        jobs = []
        for model in VISION_MODELS:
            lr_dp, lr_dec = self.vision_dp_lr(model), best_lr[model]
            for s in VISION_SEEDS[1:]:
                jobs.append(
                    (
                        f"vision {model} dp lr {lr_dp:g}",
                        job(f"vision {model} dp lr {lr_dp:g}", "dp", vision_arm(model, "dp", lr_dp), s),
                    )
                )
                a = f"vision {model} decoupled lr {lr_dec:g}"
                jobs.append(
                    (a, job(a, "decoupled", [*vision_arm(model, "decoupled", lr_dec), f"algo.on_merged={rule}"], s))
                )
        self.run(jobs)

    def phase_d(self) -> None:
        rule, h = self.best_rule()
        jobs = []
        for s in MOE_SEEDS:
            jobs.append(("moe dp", job("moe dp", "dp", [*BASE, *DP, *MOE], s)))
            arm = f"moe decoupled {rule} H={h}"
            jobs.append((arm, job(arm, "decoupled", [*overlap_arm(rule, h), *MOE], s)))
        self.run(jobs)

    def chaos(self, seeds: tuple[int, ...]) -> list[tuple[str, Job]]:
        rule, h = self.best_rule()
        arm = f"chaos decoupled {rule} H={h}"
        return [(arm, job(arm, "decoupled", [*overlap_arm(rule, h), *q.CHAOS], s)) for s in seeds]

    def phase_e(self) -> None:
        self.run(self.chaos(SEEDS5[:3]))

    def phase_f(self) -> None:
        self.run([*self.dense_seeds(SEEDS5[3:]), *self.chaos(SEEDS5[3:])])

    def phase_g(self) -> None:
        self.run([("diloco", job("diloco", "diloco", [*BASE, *DIL], s)) for s in SEEDS5])

    def phase_h(self) -> None:
        rule, h = self.best_rule()
        m8 = [o for o in BASE if not o.startswith(("run.num_learners", "run.processed_tokens"))]
        m8 += ["run.num_learners=8", f"run.processed_tokens={2 * q.TOKENS}"]
        arm = f"M=8 decoupled {rule} H={h}"
        dec = [*m8, *DEC, f"algo.sync_every={h}", f"algo.on_merged={rule}"]
        self.run([("M=8 dp", job("M=8 dp", "dp", [*m8, *DP], 0)), (arm, job(arm, "decoupled", dec, 0))])


# ----------------------------------------------------------------------------- the report


def by_seed(b: Bench, arm: str) -> dict[int, dict[str, Any]]:
    out = {}
    for label in b.arms.get(arm, []):
        r = b.results.get(label)
        if r is not None:
            out[int(label.rsplit(" seed ", 1)[1])] = r
    return out


def paired(
    b: Bench, arm: str, ref: str, at_tokens: bool = False, key: str = "eval_loss", only: int | None = None
) -> dict[str, Any]:
    """An arm against its reference, paired by seed (``only``: that seed alone): mean and 95%
    interval of the ratio (or, for accuracy, the difference in points)."""
    runs, refs = by_seed(b, arm), by_seed(b, ref)
    seeds = sorted(s for s in set(runs) & set(refs) if only is None or s == only)
    row: dict[str, Any] = {"arm": arm, "ref": ref, "seeds": seeds, "runs": len(runs)}
    if not seeds:
        return row
    if key == "accuracy":
        diffs = [100 * (runs[s]["evals"][-1]["accuracy"] - refs[s]["evals"][-1]["accuracy"]) for s in seeds]
        row["acc"] = q.ci95([100 * runs[s]["evals"][-1]["accuracy"] for s in seeds])[0]
        row["acc_ref"] = q.ci95([100 * refs[s]["evals"][-1]["accuracy"] for s in seeds])[0]
        row["points"] = q.ci95(diffs)
        return row
    ratios = []
    for s in seeds:
        ref_loss = q.loss_at(refs[s], runs[s]["tokens_processed"]) if at_tokens else refs[s]["eval_loss"]
        ratios.append(runs[s]["eval_loss"] / ref_loss)
    row["loss"] = q.ci95([runs[s]["eval_loss"] for s in seeds])[0]
    row["ratio"] = q.ci95(ratios)
    row["merged_share"] = q.ci95([runs[s]["merged_share"] for s in seeds])[0]
    row["goodput"] = q.ci95([runs[s]["goodput"] for s in seeds])[0]
    row["tokens"] = q.ci95([runs[s]["tokens_processed"] for s in seeds])[0]
    return row


def summarise(b: Bench) -> dict[str, Any]:
    rule, h = b.best_rule()
    best = f"decoupled {rule} H={h}"
    rep: dict[str, Any] = {"best": {"on_merged": rule, "sync_every": h}, "settings": b.settings}
    rep["overlap"] = [
        {
            **paired(b, f"decoupled {r} H={hh}", "dp", only=0),
            "rule": r,
            "H": hh,
        }
        for hh in q.H_GRID
        for r in RULES
    ] + [{**paired(b, "diloco H=24 (control)", "dp", only=0), "rule": "synchronous DiLoCo", "H": 24}]
    rep["dense"] = [paired(b, best, "dp"), paired(b, "diloco", "dp"), paired(b, f"chaos {best}", "dp", at_tokens=True)]
    rep["moe"] = [paired(b, f"moe {best}", "moe dp")]
    vision = []
    lrs = b.settings.get("vision_lr", {})
    for model in VISION_MODELS:
        if model in lrs:
            dp_arm = f"vision {model} dp lr {lrs[model]['dp']:g}"
            dec_arm = f"vision {model} decoupled lr {lrs[model]['decoupled']:g}"
            vision.append(
                {**paired(b, dec_arm, dp_arm, key="accuracy"), "model": model, "loss": paired(b, dec_arm, dp_arm)}
            )
    rep["vision"] = vision
    rep["vision_sweep"] = {
        label: {"loss": r["eval_loss"], "accuracy": r["evals"][-1].get("accuracy")}
        for label, r in b.results.items()
        if label.startswith("vision") and label.endswith("seed 0")
    }
    rep["m8"] = [paired(b, f"M=8 {best}", "M=8 dp")]
    rep["arms_without_runs"] = sorted(a for a in b.arms if not by_seed(b, a))
    return rep


def _ci(t: Any, fmt: str = "{:.4f}") -> str:
    if not t:
        return "not run"
    m, lo, hi = t
    return f"{fmt.format(m)} [{fmt.format(lo)}, {fmt.format(hi)}]" if lo != hi else fmt.format(m)


def to_markdown(rep: dict[str, Any], facts: dict[str, Any]) -> str:
    out = ["# Quality parity, widened (issue 22)", ""]
    out.append(f"`{facts['command']}` on {facts['date']}; code digest {facts['code_digest']}; "
               f"{facts['runs']} runs, {facts['cpu_s_all_runs'] / 3600:.2f} CPU-hours. Ratios are to DP, "
               "paired by seed, mean [95% t-interval]; read in [../quality.md](../quality.md).")  # fmt: skip
    out += [
        "",
        "## The overlap rules (seed 0)",
        "",
        "| rule | H | loss | L / L_dp | merged share |",
        "|---|---|---|---|---|",
    ]
    for r in rep["overlap"]:
        if "ratio" in r:
            out.append(f"| {r['rule']} | {r['H']} | {r['loss']:.4f} | {r['ratio'][0]:.4f} | {r['merged_share']:.1%} |")
        else:
            out.append(f"| {r['rule']} | {r['H']} | not run | | |")
    out += ["", f"Best: `algo.on_merged = \"{rep['best']['on_merged']}\"` at H = {rep['best']['sync_every']}.", ""]
    out += [
        "## Dense GPT, M = 4",
        "",
        "| arm | seeds | loss | L / L_dp | merged | goodput |",
        "|---|---|---|---|---|---|",
    ]
    for r in [*rep["dense"], *rep["moe"], *rep["m8"]]:
        if "ratio" in r:
            out.append(
                f"| {r['arm']} (vs {r['ref']}) | {len(r['seeds'])} | {r['loss']:.4f} | {_ci(r['ratio'])} | "
                f"{r['merged_share']:.1%} | {r['goodput']:.1%} |"
            )
        else:
            out.append(f"| {r['arm']} (vs {r['ref']}) | 0 | not run | | | |")
    out += ["", "## Vision (Fashion-MNIST, test accuracy on 2,000 test images)", ""]
    out += ["| model | seeds | accuracy | DP accuracy | points vs DP | L / L_dp |", "|---|---|---|---|---|---|"]
    for r in rep["vision"]:
        if "points" in r:
            out.append(
                f"| {r['model']} | {len(r['seeds'])} | {r['acc']:.2f}% | {r['acc_ref']:.2f}% | "
                f"{_ci(r['points'], '{:+.2f}')} | {_ci(r['loss'].get('ratio'))} |"
            )
    out += ["", "LR brackets at seed 0 (loss, accuracy):", ""]
    for label, v in sorted(rep["vision_sweep"].items()):
        acc = f"{100 * v['accuracy']:.2f}%" if v["accuracy"] is not None else "-"
        out.append(f"- {label}: {v['loss']:.4f}, {acc}")
    if rep["arms_without_runs"]:
        out += ["", "Cut (no runs): " + ", ".join(rep["arms_without_runs"]) + "."]
    return "\n".join(out) + "\n"


PHASES = "ABCDEFGH"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2, help="runs at once (one thread each)")
    ap.add_argument("--phases", default=PHASES, help="which phases, e.g. A,B (default: all, in order)")
    ap.add_argument("--report", action="store_true", help="only cached runs: no training")
    ap.add_argument("--cache", default=str(ROOT / "bench" / "cache" / "breadth"), help="folder of cached runs")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"), help="folder for breadth.md/.json")
    args = ap.parse_args()
    wanted = [p for p in args.phases.upper().replace(",", "") if p in PHASES]
    if not wanted:
        print(f"error: --phases {args.phases!r} names none of {', '.join(PHASES)}")
        return 2
    started, code = time.time(), q.code_digest()
    runner = q.Runner(Path(args.cache), args.workers, code)
    b = Bench(runner, train=not args.report)
    # Every phase after A reads A's choice: with --report or a later phase alone, A's cached runs.
    for p in PHASES:
        if p == "A" or p in wanted:
            train = b.train
            b.train = train and p in wanted
            getattr(b, f"phase_{p.lower()}")()
            b.train = train
    rep = summarise(b)
    args.quick, args.verify = False, ""
    facts = q.invocation_facts(args, started, runner, code)
    facts["command"] = (
        "python bench/breadth.py"
        + (" --report" if args.report else "")
        + (f" --phases {args.phases}" if args.phases != PHASES else "")
    )
    rep.update(facts)
    q.publish(Path(args.out), "breadth", rep, to_markdown(rep, facts))
    runner.pool.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
