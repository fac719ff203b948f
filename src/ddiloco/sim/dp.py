"""The data-parallel reference: one model, gradients of M x B examples every step."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ddiloco.config import Config
from ddiloco.report.accounting import Goodput
from ddiloco.report.result import Progress, RunResult
from ddiloco.training.evaluate import eval_figures
from ddiloco.training.inner import inner_step, lr_at, make_optimizer
from ddiloco.workloads.base import Workload, loss_unit


def run_data_parallel(
    cfg: Config,
    workload: Workload,
    on_progress: Progress | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> RunResult:
    """Train one model on the M shards' batches together (no failures: the healthy reference).

    Each step averages the loss over one batch from every shard, which equals averaging M
    learners' gradients; a step takes one ``sim.step_time_s`` of virtual time.
    """
    if cfg.chaos.enabled:
        from ddiloco.errors import ConfigError

        raise ConfigError(
            "chaos is not modelled for run.method = 'dp' (it is the healthy reference); set chaos.enabled = false"
        )
    torch.use_deterministic_algorithms(True)
    r = cfg.run
    model = workload.build_model(r.seed)
    opt = make_optimizer(model, cfg.inner)
    streams = [workload.train_stream(m, r.num_learners, r.seed) for m in range(r.num_learners)]
    eval_batches = workload.eval_batches()
    probe = streams[0].next_batch()
    streams[0].seek(0)
    steps = math.ceil(r.processed_tokens / (r.num_learners * probe.tokens))
    horizon = steps * cfg.sim.step_time_s
    eval_at = {round(steps * k / (r.eval_points + 1)) for k in range(1, r.eval_points + 1)}
    evals, tokens, partial = [], 0, False
    for step in range(1, steps + 1):
        if should_stop is not None and should_stop():
            partial = True
            evals.append({"time": (step - 1) * cfg.sim.step_time_s, "tokens": tokens, "merged_tokens": tokens,
                          **eval_figures(workload, model, eval_batches), "final": True})  # fmt: skip
            horizon = (step - 1) * cfg.sim.step_time_s
            break
        model.train()
        batches = [s.next_batch() for s in streams]
        loss = sum(workload.loss(model, b) for b in batches) / len(batches)
        inner_step(model, opt, loss, lr_at(tokens, r.processed_tokens, cfg.inner), cfg.inner.grad_clip)
        tokens += sum(b.tokens for b in batches)
        if step in eval_at or step == steps:
            t = step * cfg.sim.step_time_s
            evals.append(
                {
                    "time": t,
                    "tokens": tokens,
                    "merged_tokens": tokens,
                    **eval_figures(workload, model, eval_batches),
                    "final": step == steps,
                }
            )
            if on_progress:
                on_progress(min(tokens, r.processed_tokens), r.processed_tokens, "tokens processed")
    return RunResult(
        method="dp",
        final_loss=evals[-1]["loss"],
        evals=evals,
        horizon_s=horizon,
        tokens_processed=tokens,
        tokens_merged=tokens,
        goodput=Goodput(1.0, 0.0, 0.0, 0.0),
        uptime=1.0,
        lost_steps=0.0,
        failures=0,
        num_fragments=1,
        rounds_per_fragment=float(step - 1 if partial else steps),
        learners_per_merge=float(r.num_learners),
        grace_admissions=0,
        rejected=0,
        late=0,
        state={k: v.detach().clone() for k, v in model.state_dict().items()},
        num_learners=r.num_learners,
        loss_unit=loss_unit(workload),
        partial=partial,
    )
