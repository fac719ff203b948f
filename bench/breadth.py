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
I. MoE expert weighting: Decoupled DiLoCo with ``algo.expert_weights = "routed"`` (each expert's
   rows merged by the tokens each learner routed to it) beside plain token weighting, seeds 0-1;
   and plain seed 0 again at the current code, which must give D's loss to the bit (see EARLIER).
J. M scaling: the outer LR swept at M = 2 (4.1M tokens, 2,000 steps per learner), 4 and 8 (8.2M,
   1,000 steps per learner), H, inner LR and momentum at M = 4's choice; DP at its M = 4 LR and
   at that LR scaled by sqrt(M / 4) (its batch is M x 8), the better one the reference. Seed 0.
K. The dense re-sweep at the chosen H: inner LR x/÷ sqrt(2) and outer momentum 0.8 (J's M = 4
   points are its outer LR coordinate), seed 0; a point better than the chosen one by more than
   RULE_NOISE gets seeds 0-4.
L. Vision, the Decoupled inner LR bracket extended: a model whose best was the bracket's lower
   edge (lr_dp / 4) tries lr_dp / 8 at seed 0; the better LR then runs seed 1 too.

Phases run in the order of PHASES (G, a baseline without a target, last). What is cut when the
compute runs out is said in the report (arms with no runs).
"""

from __future__ import annotations

import argparse
import json
import math
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
ROUTED = ["algo.expert_weights=routed"]
EARLIER = ("3625e1326200f30f",)
"""Code digests whose cached runs the report still reads when the current code has not run
them: since 3625e1326200f30f the simulator changed only by ``algo.expert_weights`` (off by
default: no counts are sent or used) and by the MoE GPT reusing the dense GPT's init and
forward (the same draws in the same order). Phase I reruns a MoE run at the current code, and
the report says whether it gives the earlier loss to the bit; the golden runs are unchanged."""
M_POINTS: dict[int, tuple[tuple[float, float], ...]] = {
    2: ((0.25, 0.9), (0.35, 0.9), (0.5, 0.9), (0.7, 0.9)),
    4: ((0.35, 0.9), (0.5, 0.9), (0.7, 0.9)),
    8: ((0.35, 0.9), (0.5, 0.9), (0.7, 0.9), (1.0, 0.9), (0.5, 0.8)),
}
"""(outer LR, outer momentum) per M (phase J): a bracket around M = 4's 0.5, first shifted up at
M = 8 (a mean of more learners is less noisy, so it might bear a longer step); extended past
the edge where the best fell (M = 2 down to 0.25, M = 8 down to 0.35), and M = 8 at momentum
0.8, which phase K found better at M = 4."""
M_TOKENS = {2: q.TOKENS, 4: q.TOKENS, 8: 2 * q.TOKENS}
"""Tokens per M: the regime's bound (2,000 DP steps, >= 80 outer steps per fragment at H = 24)
at every M; M = 2 keeps M = 4's budget (2,000 steps per learner)."""

Job = q.Job


class Runner(q.Runner):
    """quality.py's runner, reading also the runs of the EARLIER digests (unless a job must
    run at the current code: ``fresh``)."""

    def __init__(self, cache: Path, workers: int, code: str, earlier: tuple[str, ...] = EARLIER) -> None:
        super().__init__(cache, workers, code)
        self.earlier = tuple(c for c in earlier if c != code)
        self.fresh: set[str] = set()  # keys that only the current code may answer

    def cached(self, method: str, overrides: tuple[str, ...]) -> dict[str, Any] | None:
        hit = super().cached(method, overrides)
        if hit is not None or self.key(method, overrides) in self.fresh:
            return hit
        for code in self.earlier:
            old = self.cached_at(method, overrides, code)
            if old is not None:
                return old
        return None

    def cached_at(self, method: str, overrides: tuple[str, ...], code: str) -> dict[str, Any] | None:
        """The cached run of a job at code digest ``code`` (None if there is none)."""
        p = self.cache / f"{method}-{q.job_key(method, overrides, code)}.json"
        try:
            hit = json.loads(p.read_text()) if p.exists() else None
        except (OSError, ValueError):
            return None
        return hit if isinstance(hit, dict) and hit.get("code") == code else None


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
        self.wanted = PHASES  # the phases asked for (main sets it)

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

    def phase_i(self) -> None:
        rule, h = self.best_rule()
        plain = f"moe decoupled {rule} H={h}"
        jobs = [(plain, job(plain, "decoupled", [*overlap_arm(rule, h), *MOE], s)) for s in MOE_SEEDS]
        routed = f"moe decoupled {rule} H={h} routed"
        jobs += [(routed, job(routed, "decoupled", [*overlap_arm(rule, h), *MOE, *ROUTED], s)) for s in MOE_SEEDS]
        # The same job as plain seed 0, trained again at the current code (its own label).
        _, method, over = jobs[0][1]
        again = ("moe rerun at the current code seed 0", method, over)
        self.runner.fresh.add(self.runner.key(method, over))
        self.settings["rerun"] = {"method": method, "overrides": list(over)}
        if self.train:
            for j in [*(j for _, j in jobs), again]:  # I's runs first in the pool's queue, then J's
                self.runner.submit(j)  # (which need nothing from I): no worker idles behind I's last
            if "J" in self.wanted:
                for _, j in self.j_jobs():
                    self.runner.submit(j)
        self.run([*jobs, ("moe rerun at the current code", again)])

    def m_base(self, m: int) -> list[str]:
        kept = [o for o in BASE if not o.startswith(("run.num_learners", "run.processed_tokens"))]
        return [*kept, f"run.num_learners={m}", f"run.processed_tokens={M_TOKENS[m]}"]

    def m_dp_lrs(self, m: int) -> tuple[float, ...]:
        lr = float(DP[0].split("=")[1])
        return (lr,) if m == q.M else (lr, round(lr * math.sqrt(m / q.M), 7))

    def m_arm(self, m: int, outer: float, momentum: float = 0.9) -> tuple[str, list[str]]:
        rule, h = self.best_rule()
        over = [*self.m_base(m), *DEC[:1], f"algo.outer_lr={outer:g}", f"algo.outer_momentum={momentum:g}"]
        label = f"M={m} decoupled {rule} H={h} outer {outer:g}" + (f" momentum {momentum:g}" if momentum != 0.9 else "")
        return label, [*over, f"algo.sync_every={h}", f"algo.on_merged={rule}"]

    def m_dp_arm(self, m: int, lr: float) -> str:
        """DP's arm at M learners and inner LR ``lr`` (M = 4 and M = 8 at M = 4's LR keep the
        labels of phases B and H)."""
        if m == q.M and lr == self.m_dp_lrs(m)[0]:
            return "dp"
        if lr == self.m_dp_lrs(m)[0]:
            return f"M={m} dp"
        return f"M={m} dp lr {lr:g}"

    def phase_j(self) -> None:
        self.run(self.j_jobs())

    def j_jobs(self) -> list[tuple[str, Job]]:
        jobs = []
        for m in (2, 4, 8):
            for lr in self.m_dp_lrs(m):
                arm = self.m_dp_arm(m, lr)
                jobs.append((arm, job(arm, "dp", [*self.m_base(m), f"inner.lr={lr:g}"], 0)))
            for outer, momentum in M_POINTS[m]:
                arm, over = self.m_arm(m, outer, momentum)
                if m == q.M and (outer, momentum) == (0.5, 0.9):
                    arm = "decoupled {} H={}".format(*self.best_rule())  # phase B's run
                jobs.append((arm, job(arm, "decoupled", over, 0)))
        return jobs

    def k_points(self) -> dict[str, list[str]]:
        """Phase K's points: label -> overrides (the chosen rule and H, one coordinate moved)."""
        rule, h = self.best_rule()
        inner = float(DEC[0].split("=")[1])
        base = overlap_arm(rule, h)
        points = {}
        for lr in (inner / math.sqrt(2), inner * math.sqrt(2)):
            points[f"decoupled {rule} H={h} inner {lr:.3g}"] = [*base, f"inner.lr={lr:.3g}"]
        for momentum in (0.8, 0.6):  # 0.6: past 0.8, which beat 0.9
            points[f"decoupled {rule} H={h} momentum {momentum:g}"] = [*base, f"algo.outer_momentum={momentum:g}"]
        return points

    def k_best(self) -> str | None:
        """The label of phase K's (or J's M = 4) point that beats the chosen one by more than
        RULE_NOISE at seed 0, if any."""
        rule, h = self.best_rule()
        chosen = self.loss(f"decoupled {rule} H={h} seed 0")
        tried = [*self.k_points(), *(self.m_arm(q.M, o, mo)[0] for o, mo in M_POINTS[q.M] if (o, mo) != (0.5, 0.9))]
        losses = sorted((self.loss(f"{label} seed 0"), label) for label in tried)
        if not losses or losses[0][0] == float("inf") or losses[0][0] * (1 + RULE_NOISE) >= chosen:
            return None
        return losses[0][1]

    def phase_l(self) -> None:
        rule, _ = self.best_rule()
        lrs = self.settings.get("vision_lr", {})
        for model in VISION_MODELS:
            if model not in lrs:
                continue
            lr_dp, chosen = lrs[model]["dp"], lrs[model]["decoupled"]
            if chosen != lr_dp / 4:
                continue  # not at the lower edge: C's bracket holds its best
            lower = lr_dp / 8
            arm = f"vision {model} decoupled lr {lower:g}"
            over = [*vision_arm(model, "decoupled", lower), f"algo.on_merged={rule}"]
            self.run([(arm, job(arm, "decoupled", over, 0))])
            if self.loss(f"{arm} seed 0") < self.loss(f"vision {model} decoupled lr {chosen:g} seed 0"):
                lrs[model]["decoupled"] = lower
                self.run([(arm, job(arm, "decoupled", over, s)) for s in VISION_SEEDS[1:]])

    def phase_k(self) -> None:
        points = self.k_points()
        self.run([(label, job(label, "decoupled", over, 0)) for label, over in points.items()])
        best = self.k_best()
        if best is None:
            return
        over = points.get(best) or self.m_arm(q.M, float(best.rsplit(" ", 1)[1]))[1]
        self.settings["resweep_best"] = best
        self.run([(best, job(best, "decoupled", over, s)) for s in SEEDS5])
        arm = f"chaos {best}"  # the final settings under chaos, judged at their token count
        self.run([(arm, job(arm, "decoupled", [*over, *q.CHAOS], s)) for s in SEEDS5])


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
    rep["moe_weighting"] = [
        paired(b, f"moe {best} routed", "moe dp"),
        paired(b, f"moe {best} routed", f"moe {best}"),
    ]
    rerun = b.settings.get("rerun")
    if rerun is not None:
        runner = b.runner
        if not isinstance(runner, Runner):
            raise TypeError("the report needs breadth.Runner (it reads runs of earlier digests)")
        over = tuple(rerun["overrides"])
        now = runner.cached_at(rerun["method"], over, runner.code)
        then = [(c, runner.cached_at(rerun["method"], over, c)) for c in runner.earlier]
        rep["rerun"] = {
            "current": {"code": runner.code, "eval_loss": now["eval_loss"] if now else None},
            "earlier": [{"code": c, "eval_loss": r["eval_loss"] if r else None} for c, r in then],
        }
    rep["m_scaling"] = m_scaling(b)
    rep["resweep"] = {
        label: b.loss(f"{label} seed 0") for label in [best, *b.k_points()] if b.loss(f"{label} seed 0") < float("inf")
    }
    best_k = b.settings.get("resweep_best")
    rep["resweep_best"] = paired(b, best_k, "dp") if best_k else None
    rep["resweep_chaos"] = paired(b, f"chaos {best_k}", "dp", at_tokens=True) if best_k else None
    rep["arms_without_runs"] = sorted(a for a in b.arms if not by_seed(b, a))
    return rep


def m_scaling(b: Bench) -> list[dict[str, Any]]:
    """Per M: DP at its better LR, each outer LR's Decoupled loss at seed 0 and its ratio to it."""
    rows = []
    for m in (2, 4, 8):
        dps = {lr: b.loss(f"{b.m_dp_arm(m, lr)} seed 0") for lr in b.m_dp_lrs(m)}
        lr_dp = min(dps, key=lambda lr: dps[lr])
        row: dict[str, Any] = {"M": m, "tokens": M_TOKENS[m], "dp_lr": lr_dp, "dp_loss": dps[lr_dp], "dp_by_lr": dps}
        row["steps_per_learner"] = M_TOKENS[m] // (m * q.BATCH * q.SEQ)
        row["outer"] = {}
        for outer, momentum in M_POINTS[m]:
            arm = b.m_arm(m, outer, momentum)[0]
            if m == q.M and (outer, momentum) == (0.5, 0.9):
                arm = "decoupled {} H={}".format(*b.best_rule())
            r = b.results.get(f"{arm} seed 0")
            if r is not None and dps[lr_dp] < float("inf"):
                row["outer"][f"{outer:g} / {momentum:g}"] = {
                    "loss": r["eval_loss"],
                    "ratio": r["eval_loss"] / dps[lr_dp],
                    "merged_share": r["merged_share"],
                }
        if row["outer"]:
            row["best_outer"] = min(row["outer"], key=lambda o: row["outer"][o]["loss"])
        rows.append(row)
    return rows


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
        "## Paired with DP (dense GPT at M = 4 unless the arm says otherwise)",
        "",
        "| arm | seeds | loss | L / L_dp | merged | goodput |",
        "|---|---|---|---|---|---|",
    ]
    final = [r for r in (rep.get("resweep_best"), rep.get("resweep_chaos")) if r]  # K's better settings
    for r in [*rep["dense"], *final, *rep["moe"], *rep["m8"]]:
        if "ratio" in r:
            out.append(
                f"| {r['arm']} (vs {r['ref']}) | {len(r['seeds'])} | {r['loss']:.4f} | {_ci(r['ratio'])} | "
                f"{r['merged_share']:.1%} | {r['goodput']:.1%} |"
            )
        else:
            out.append(f"| {r['arm']} (vs {r['ref']}) | 0 | not run | | | |")
    out += ["", "## MoE expert weighting", "", "| arm | seeds | loss | ratio | merged |", "|---|---|---|---|---|"]
    for r in rep["moe_weighting"]:
        if "ratio" in r:
            out.append(
                f"| {r['arm']} (vs {r['ref']}) | {len(r['seeds'])} | {r['loss']:.4f} | {_ci(r['ratio'])} | "
                f"{r['merged_share']:.1%} |"
            )
        else:
            out.append(f"| {r['arm']} (vs {r['ref']}) | 0 | not run | | |")
    rerun = rep.get("rerun")
    if rerun:
        now = rerun["current"]
        for e in rerun["earlier"]:
            same = e["eval_loss"] is not None and e["eval_loss"] == now["eval_loss"]
            out.append(
                f"\nThe MoE seed 0 run at the current code ({now['code']}): loss {now['eval_loss']}; at "
                f"{e['code']}: {e['eval_loss']} ({'the same to the bit' if same else 'NOT the same'})."
            )
    out += ["", "## M scaling (seed 0)", ""]
    out += ["| M | tokens | steps per learner | DP LR | DP loss | outer LR / momentum | loss | L / L_dp | merged |"]
    out += ["|---|---|---|---|---|---|---|---|---|"]
    for r in rep["m_scaling"]:
        for outer, v in r["outer"].items():
            mark = " (best)" if outer == r.get("best_outer") else ""
            out.append(
                f"| {r['M']} | {r['tokens'] / 1e6:.1f}M | {r['steps_per_learner']} | {r['dp_lr']:g} | "
                f"{r['dp_loss']:.4f} | {outer}{mark} | {v['loss']:.4f} | {v['ratio']:.4f} | {v['merged_share']:.1%} |"
            )
        if not r["outer"]:
            out.append(f"| {r['M']} | {r['tokens'] / 1e6:.1f}M | {r['steps_per_learner']} | | | not run | | | |")
    dp_lrs = "; ".join(
        f"M = {r['M']}: " + ", ".join(f"{lr:g} -> {loss:.4f}" for lr, loss in r["dp_by_lr"].items())
        for r in rep["m_scaling"]
    )
    out += ["", f"DP by LR (seed 0): {dp_lrs}."]
    if rep["resweep"]:
        out += ["", "## Re-sweep at the chosen H (seed 0)", ""]
        out += [f"- {label}: {loss:.4f}" for label, loss in rep["resweep"].items()]
        best = rep.get("resweep_best")
        if best and "ratio" in best:
            out.append(f"\nBetter point, {len(best['seeds'])} seeds: {best['arm']}: {_ci(best['ratio'])} x DP.")
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


PHASES = "ABCDEFHIJKLG"


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
    runner = Runner(Path(args.cache), args.workers, code)
    b = Bench(runner, train=not args.report)
    b.wanted = "".join(wanted)
    # Later phases read earlier ones' choices (A's rule, C's vision LRs, J's points): every phase
    # runs, those not asked for from the cache only, so the report is always the whole one.
    train = b.train
    for p in PHASES:
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
