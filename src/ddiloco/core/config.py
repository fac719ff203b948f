"""The algorithm's knobs: one frozen dataclass shared by the syncer and the learners.

Baselines are configurations of these same knobs (see ``methods.py``), not separate code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeGuard, get_args

from ddiloco.core.compress import CHUNK, Encoding, is_lossy, sparse
from ddiloco.errors import require, require_one_of

# Each choice is a Literal type (what mypy and the config loader see); the allowed tuples are
# derived from it, so the two cannot drift apart.
FragmentStrategy = Literal["balanced", "per_layer", "strided"]
Merge = Literal["rda", "mean"]
Anchor = Literal["base", "current"]
LateFragment = Literal["continue", "wait"]
Staleness = Literal["none", "scaled", "delayed"]
OnMerged = Literal["overwrite", "shift", "eager"]
ExpertWeights = Literal["tokens", "routed"]
FRAGMENT_STRATEGIES: tuple[FragmentStrategy, ...] = get_args(FragmentStrategy)
MERGES: tuple[Merge, ...] = get_args(Merge)
ANCHORS: tuple[Anchor, ...] = get_args(Anchor)
LATE_FRAGMENT: tuple[LateFragment, ...] = get_args(LateFragment)
STALENESS: tuple[Staleness, ...] = get_args(Staleness)
ON_MERGED: tuple[OnMerged, ...] = get_args(OnMerged)
EXPERT_WEIGHTS: tuple[ExpertWeights, ...] = get_args(ExpertWeights)
ENCODING_NAMES: tuple[Encoding, ...] = get_args(Encoding)


@dataclass(frozen=True)
class DiLoCoConfig:
    """Decoupled DiLoCo's algorithm settings (the paper's defaults where it gives them)."""

    num_fragments: int | Literal["auto"] = "auto"
    """P, the number of parameter fragments (>= 1), or "auto" for the model's default: the
    largest P <= H whose largest fragment is at most 1.25x the mean."""
    fragment_strategy: FragmentStrategy = "balanced"
    """How tensors are grouped: balanced (greedy bin-packing by size, rows of large tensors
    split when needed), per_layer, or strided (tensor i goes to fragment i mod P)."""
    sync_every: int = 24
    """H: inner steps between two outer steps of the same fragment."""
    overlap: int = 2
    """tau: inner steps a fragment may be in flight (0 <= tau < H)."""
    quorum: int | Literal["all"] = 1
    """K: distinct learners whose answers a round needs before it may close (>= 1), or "all"
    for every live learner. The effective quorum is min(K, live learners)."""
    grace: bool = True
    """Whether the adaptive grace window admits more learners after the quorum is reached."""
    grace_gamma: float = 0.8
    """gamma: safety margin of the grace window (grace = gamma*(tau*t_step - t_quorum - t_sync))."""
    max_grace_steps: float = 1.0
    """Upper clamp of the grace window, in inner steps."""
    ema_decay: float = 0.9
    """Decay of the exponential moving averages of step, quorum and sync durations."""
    liveness_timeout_s: float = 5.0
    """A learner not heard from for this long is not live: no round waits for it."""
    keep_versions: int = 4
    """S: past versions of each fragment kept to anchor contributions; older bases are stale."""
    anchor: Anchor = "base"
    """Anchor of the outer gradient: 'base' (the global value the learner started from) or
    'current' (the latest global value; only for ablations)."""
    merge: Merge = "rda"
    """Merge of non-embedding tensors: weighted radial-directional averaging or weighted mean."""
    expert_weights: ExpertWeights = "tokens"
    """How the merge weighs the rows of an expert-stacked tensor (a mixture of experts' experts
    on dim 0): "tokens" weighs each learner's whole tensor by its token weight w; "routed" shares
    w among the rows in proportion to the tokens the learner routed to each (row e:
    w x E x r_e / sum(r), E rows; the counts its training loop passes to ``step(routed=...)``),
    so an expert's update comes mostly from the learners that used it, and counts can move a
    learner's weight between experts but never add to it. Rows no answer routed a token to get
    no outer gradient (momentum still moves them). A piece falls back to "tokens" in a round
    where a weighted answer carries no counts for it."""
    outer_lr: float = 0.7
    """Outer learning rate of the per-fragment Nesterov SGD."""
    outer_momentum: float = 0.9
    """Outer momentum (Nesterov)."""
    staleness: Staleness = "none"
    """How the outer step treats stale answers (answers whose base is behind the current
    version); it matters when rounds close on few learners (K = 1 without grace):
    "none": an answer that misses its round waits for the fragment's next round, and is merged
    like any other; "scaled": each outer gradient is scaled by 1 / (1 + s), s = versions its
    base is behind (staleness-aware asynchronous SGD); "delayed": an answer that misses its round
    is merged at once into a version of its own, every merge moves the fragment by its share of
    the live fleet (answers / live learners), and the momentum is updated once a whole fleet's
    share has been merged (delayed Nesterov, as in asynchronous Local-SGD)."""
    outer_lr_decay_tokens: float = 0.0
    """If > 0, the outer LR follows a cosine from outer_lr down to 10% of it over this many
    globally merged tokens (like the inner schedule); 0 keeps it constant (DiLoCo's choice)."""
    alpha: float = 0.0
    """Blend on receipt: local = alpha*local + (1-alpha)*global; 0 overwrites (the default).
    Only with ``on_merged = "overwrite"``."""
    on_merged: OnMerged = "overwrite"
    """How a learner takes a merged version of a fragment it kept training while the round was
    open (the tau overlap steps, and any steps after a contribution that missed its round):
    "overwrite": the fragment becomes the merged version (the overlap steps are lost);
    "shift": it moves by the merged change, local + (Theta_new - Theta_base), so the steps since
    the contribution are kept and go into the next one (their tokens are counted there);
    "eager": as "shift", and when a contribution leaves, the learner first moves the fragment to
    its own guess of the next version, Theta_base - outer_lr x its own outer gradient (its delta
    standing in for the round's mean, without the syncer's momentum; Kale et al. 2025), so the
    overlap steps are computed near where the merge will land; the merge then replaces the guess.
    Joins and rebases always overwrite."""
    late_fragment: LateFragment = "continue"
    """'continue' never blocks (Decoupled DiLoCo); 'wait' blocks at step send+tau until the
    fragment arrives (lock-step baselines), with learners sending on their own schedule."""
    syncer_timeout_s: float = 60.0
    """A 'wait' learner gives up waiting for a fragment after this long and trains on."""
    max_tokens_per_step: float = 1e7
    """Validation bound on a contribution's tokens/steps: the weight is quadratic in tokens,
    so one bad counter would dominate a merge."""
    max_delta_norm: float = 1e6
    """Validation bound on the L2 norm of a contribution's outer gradient (absolute)."""
    max_count_per_step: int = 64
    """Bound on how far an integer buffer (BatchNorm's ``num_batches_tracked``) may grow per
    inner step of a contribution: a forward pass per micro-batch, with room for accumulation."""
    max_delta_ratio: float = 1.0
    """Bound on an outer gradient's norm relative to its fragment: at most max_delta_ratio x
    |Theta_p| + max_delta_floor x sqrt(numel_p). Honest deltas are a few percent of it."""
    max_delta_floor: float = 0.1
    """Per-element floor of that bound (fragments near zero, such as biases, still move)."""
    norm_screen_factor: float = 10.0
    """Robust screening when a round closes: a contribution whose |delta| per step exceeds this
    multiple of its reference is refused; 0 disables. The reference is the larger of the 75th
    percentile of the fragment's last 32 merged contributions (once it has 3 merged rounds: the
    LR warm-up's first rounds move far less than later ones) and the median of the other
    contributions in the same round (when there are two or more)."""
    norm_screen_min: int = 4
    """Accepted contributions (with steps) a fragment needs before screening starts: one
    round of four learners. The history survives syncer restarts."""
    weight_cap: float = 4.0
    """No learner's weight exceeds this multiple of the fleet's typical weight (the median over
    live learners of each one's recent median, each counted at most weight_cap x the lowest):
    a larger one is clipped (and its tokens with it); 0 disables."""
    robust: bool = True
    """Robust merging (``core/robust.py``): a round waits for 3 answers when 3 learners are live
    (at most one period of H steps) and is judged against the coordinate-wise median of its
    answers' directions; misaligned answers are refused, oversized ones clipped (instead of
    refused by ``norm_screen_factor``), no weight exceeds robust_weight_cap x the round's
    median, and a learner's weight follows its trust over rounds. Tolerates fewer than half of
    a round's answers."""
    robust_min_alignment: float = -0.25
    """A full-length answer (at least half the round's median steps) whose cosine with the
    round's centre is below this multiple of the round's median cosine is refused
    ("misaligned"): it moves against the fleet (reversed deltas measured -0.6 to -0.9). Honest
    full-length answers on the chaos arm went down to -0.12 (a cold restart's first steps),
    and shorter ones are noisier: between this bound and 0 they are merged with no weight."""
    robust_full_alignment: float = 0.6
    """Below this alignment an answer's weight is scaled by alignment / robust_full_alignment
    (0 at 0 or below), and its size bound (robust_clip) by its alignment. Honest full-length
    answers measured 0.78 or more on the quality benchmark's healthy arm, 0.64 or more on the
    smaller GPT of tests/test_influence_bounds.py (0.85 at the 5th percentile on its chaos
    arm); a stale straggler's and a just-restarted learner's less."""
    robust_clip: float = 3.0
    """An answer's |delta| per step is clipped to this multiple of the round's median (or of
    the fragment's history, when the round has fewer than 3 answers)."""
    robust_weight_cap: float = 2.0
    """In a round of 3 or more answers, no answer's weight exceeds this multiple of the round's
    median weight (its tokens clipped with it): one learner claiming the fleet-wide cap cannot
    hold half of a merge; 0 disables."""
    robust_trust_decay: float = 0.8
    """Per judged answer, a learner's trust keeps this much of its old value (an exponential
    average of its alignments over about 1 / (1 - decay) answers)."""
    robust_trust_full: float = 0.6
    """A learner of this trust or more keeps its full weight; below, its weight falls linearly
    to 0 at trust 0. Trust follows full-length answers only."""
    robust_drift_limit: float = 0.0
    """A learner's drift (``core/robust.py``: the push its answers repeat off the round's
    centre over rounds, over the round's median drift) at this level or above takes its
    answers' weight to 0 and its trust down as a misaligned answer would; from half of it the
    weight falls linearly. 0 (the default) disables the drift history. 3 is what the insider
    phase measured (docs/results/insider.md); it is off by default because honest learners of
    a heterogeneous fleet at quorum 1 reached drifts of 2.5 (90th percentile) to 23 in the
    simulator and lost 9% of their merged tokens, and the quality benchmark has not measured
    its honest cost yet."""
    robust_drift_decay: float = 0.9
    """Per judged answer, a learner's drift history keeps this much of its past (it sees a
    push repeated over about 1 / (1 - decay) answers; one that turns faster adds up less)."""
    max_speedup: float = 8.0
    """A contribution may not claim more steps than elapsed time allows at max_speedup x the
    fleet's median step time (plus one period of H steps)."""
    quarantine_after: int = 3
    """Rejections in a row after which a learner is quarantined: sent every fragment, and its
    answers refused until it answers from them (0 disables)."""
    min_step_time_s: float = 1e-3
    """Reported step times below this are implausible and ignored (they would drive the
    syncer's step clock)."""
    max_step_time_s: float = 3600.0
    """Reported step times above this are implausible and ignored."""
    max_learners: int = 1024
    """Learner ids the syncer registers at most; a join beyond that is refused."""
    takeover_after_s: float = 1.0
    """A new process may take over a learner id only once its holder has been silent this
    long (at least 2 heartbeat intervals); before that the join is refused, to retry."""
    up_encoding: Encoding = "fp32"
    """How a learner's contributions travel (fp32, bf16, int8, int4, int2; blockwise with a float32
    scale per 128 values for the int ones). Lossy up or down makes every contribution a delta
    against the learner's base; buffers always travel exactly."""
    down_encoding: Encoding = "fp32"
    """How merged versions travel to the learners: lossy ones as encoded changes that chain from
    the version the syncer last served the learner (a learner off the chain gets it in full)."""
    up_density: float = 1.0
    """Share of each contribution's parameter values that travel (top-k by magnitude of every
    4096, in ``up_encoding``, with their 12-bit positions); 1: all (dense). Below 1 pair it with
    ``error_feedback``: what is not sent this time is otherwise lost."""
    down_density: float = 1.0
    """Share of each merged change's values that travel down the chain (as ``up_density``); what
    is not sent stays in the change from what the syncer served, so the next change carries it
    (the chain is its error feedback)."""
    error_feedback: bool = False
    """Whether a learner adds what its lossy encoding dropped (its residual) to its next
    contribution of that fragment."""
    chain_history: int = 3
    """With a lossy down_encoding: how many of each fragment's latest encoded changes the syncer
    keeps, so that a learner restarting from its own saved state (``runtime.local_state_s``)
    catches up by them instead of taking the fragment in full, when it is at most this many
    versions behind and the changes cost fewer bytes than the fragment. Costs the syncer this
    many encoded copies of the model (int4: 1/8 of fp32 each); 0: none kept."""

    def validate(self) -> None:
        """Raise ConfigError naming the first bad field and its allowed range."""
        _check(
            self.num_fragments == "auto" or (_is_int(self.num_fragments) and self.num_fragments >= 1),
            "num_fragments",
            self.num_fragments,
            'an integer >= 1, or "auto"',
        )
        _one_of("fragment_strategy", self.fragment_strategy, FRAGMENT_STRATEGIES)
        _check(self.sync_every >= 1, "sync_every", self.sync_every, ">= 1")
        _check(
            0 <= self.overlap < self.sync_every,
            "overlap",
            self.overlap,
            f"0 <= overlap < sync_every ({self.sync_every})",
        )
        _check(
            self.quorum == "all" or (_is_int(self.quorum) and self.quorum >= 1),
            "quorum",
            self.quorum,
            'an integer >= 1, or "all" (every live learner)',
        )
        _check(0.0 <= self.grace_gamma <= 1.0, "grace_gamma", self.grace_gamma, "[0, 1]")
        _check(self.max_grace_steps >= 0, "max_grace_steps", self.max_grace_steps, ">= 0")
        _check(0.0 <= self.ema_decay < 1.0, "ema_decay", self.ema_decay, "[0, 1)")
        _check(self.liveness_timeout_s > 0, "liveness_timeout_s", self.liveness_timeout_s, "> 0")
        _check(self.keep_versions >= 1, "keep_versions", self.keep_versions, ">= 1")
        _one_of("anchor", self.anchor, ANCHORS)
        _one_of("merge", self.merge, MERGES)
        _check(self.outer_lr > 0, "outer_lr", self.outer_lr, "> 0")
        _check(0.0 <= self.outer_momentum < 1.0, "outer_momentum", self.outer_momentum, "[0, 1)")
        _check(self.outer_lr_decay_tokens >= 0, "outer_lr_decay_tokens", self.outer_lr_decay_tokens, ">= 0")
        _check(0.0 <= self.alpha < 1.0, "alpha", self.alpha, "[0, 1)")
        _one_of("on_merged", self.on_merged, ON_MERGED)
        _one_of("expert_weights", self.expert_weights, EXPERT_WEIGHTS)
        _check(
            self.alpha == 0.0 or self.on_merged == "overwrite",
            "alpha", self.alpha, f'0 with on_merged = "{self.on_merged}" (a blend only applies to "overwrite")',
        )  # fmt: skip
        _one_of("staleness", self.staleness, STALENESS)
        _one_of("late_fragment", self.late_fragment, LATE_FRAGMENT)
        _check(self.syncer_timeout_s > 0, "syncer_timeout_s", self.syncer_timeout_s, "> 0")
        _check(self.max_tokens_per_step > 0, "max_tokens_per_step", self.max_tokens_per_step, "> 0")
        _check(self.max_delta_norm > 0, "max_delta_norm", self.max_delta_norm, "> 0")
        _check(self.max_delta_ratio > 0, "max_delta_ratio", self.max_delta_ratio, "> 0")
        _check(self.max_count_per_step >= 1, "max_count_per_step", self.max_count_per_step, ">= 1")
        _check(self.max_delta_floor >= 0, "max_delta_floor", self.max_delta_floor, ">= 0")
        _check(
            self.norm_screen_factor == 0 or self.norm_screen_factor > 1,
            "norm_screen_factor", self.norm_screen_factor, "> 1, or 0 to disable",
        )  # fmt: skip
        _check(self.norm_screen_min >= 1, "norm_screen_min", self.norm_screen_min, ">= 1")
        _check(self.weight_cap == 0 or self.weight_cap >= 1, "weight_cap", self.weight_cap, ">= 1, or 0 to disable")
        _check(-1 <= self.robust_min_alignment < 1, "robust_min_alignment", self.robust_min_alignment, "in [-1, 1)")
        _check(
            0 < self.robust_full_alignment <= 1,
            "robust_full_alignment",
            self.robust_full_alignment,
            f"in (robust_min_alignment = {self.robust_min_alignment}, 1]",
        )
        _check(self.robust_clip == 0 or self.robust_clip >= 1, "robust_clip", self.robust_clip, ">= 1, or 0 to disable")
        _check(
            self.robust_weight_cap == 0 or self.robust_weight_cap >= 1,
            "robust_weight_cap",
            self.robust_weight_cap,
            ">= 1, or 0 to disable",
        )
        _check(0 <= self.robust_trust_decay < 1, "robust_trust_decay", self.robust_trust_decay, "in [0, 1)")
        _check(
            self.robust_drift_limit >= 0,
            "robust_drift_limit",
            self.robust_drift_limit,
            "> 0, or 0 to disable",
        )
        _check(0 < self.robust_drift_decay < 1, "robust_drift_decay", self.robust_drift_decay, "in (0, 1)")
        _check(
            0 < self.robust_trust_full <= 1,
            "robust_trust_full",
            self.robust_trust_full,
            "in (0, 1]",
        )
        _check(self.max_speedup >= 1, "max_speedup", self.max_speedup, ">= 1")
        _check(self.quarantine_after >= 0, "quarantine_after", self.quarantine_after, ">= 0 (0 disables)")
        _check(
            0 < self.min_step_time_s < self.max_step_time_s,
            "min_step_time_s",
            self.min_step_time_s,
            f"0 < min_step_time_s < max_step_time_s ({self.max_step_time_s})",
        )
        _check(self.max_learners >= 1, "max_learners", self.max_learners, ">= 1")
        _check(self.takeover_after_s > 0, "takeover_after_s", self.takeover_after_s, "> 0")
        _one_of("up_encoding", self.up_encoding, ENCODING_NAMES)
        _one_of("down_encoding", self.down_encoding, ENCODING_NAMES)
        for name in ("up_density", "down_density"):
            v = getattr(self, name)
            _check(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1, name, v,
                   f"in (0, 1]: the share of values sent (1: all; 1/{CHUNK} at least one per {CHUNK})")  # fmt: skip
        _check(_is_int(self.chain_history) and 0 <= self.chain_history <= 64, "chain_history", self.chain_history,
               "an integer in [0, 64]")  # fmt: skip

    @property
    def fixed_fragments(self) -> int | None:
        """P as a number, or None for the model default."""
        return None if self.num_fragments == "auto" else int(self.num_fragments)

    @property
    def up_payload(self) -> str:
        """The encoding contributions' parameters travel in (``compress``: ``up_encoding``,
        sparse below ``up_density`` 1)."""
        return sparse(self.up_encoding, self.up_density)

    @property
    def down_payload(self) -> str:
        """The encoding merged changes travel in (``down_encoding`` at ``down_density``)."""
        return sparse(self.down_encoding, self.down_density)

    @property
    def compressed(self) -> bool:
        """Whether payloads travel as deltas against the learner's base (either direction lossy)."""
        return is_lossy(self.up_payload) or is_lossy(self.down_payload)

    @property
    def quorum_size(self) -> int | None:
        """K as a number, or None for every live learner."""
        return None if self.quorum == "all" else int(self.quorum)


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _check(ok: bool, field: str, value: object, allowed: str) -> None:
    require(ok, f"algo.{field}", value, allowed)


def _one_of(field: str, value: object, choices: tuple[object, ...]) -> None:
    require_one_of(f"algo.{field}", value, choices)
