"""What a syncer shard opens on: its global model, restored from the store or built fresh
(``restore_global``), and its protocol session with what the run folder says (``open_session``)."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddiloco.config import Config
from ddiloco.core.syncer import Syncer
from ddiloco.errors import DDiLoCoError
from ddiloco.protocol.learner_session import Registration
from ddiloco.protocol.settings import said
from ddiloco.protocol.syncer_session import Budget, SyncerSession
from ddiloco.report.summary import run_started_at
from ddiloco.report.tape import read_jsonl
from ddiloco.service.base.clock import Clock
from ddiloco.service.syncer.final_model import state_keys
from ddiloco.service.syncer.store import Restored, SyncerStore
from ddiloco.settings import run_settings
from ddiloco.training.layout import ModelLayout, layout_of, param_spec, synced_tensors
from ddiloco.workloads.base import embedding_parameters
from ddiloco.workloads.config import load_workload

log = logging.getLogger(__name__)


def budget_of(cfg: Config) -> Budget:
    """The run's budget as the syncer counts it: processed tokens, merged tokens, its age."""
    return Budget(float(cfg.run.processed_tokens), float(cfg.run.merged_tokens), cfg.runtime.duration_s)


@dataclass
class GlobalModel:
    """A shard's global model, restored from its store (or built fresh): the parts a session needs."""

    layout: ModelLayout
    """The model's fragments (all of them: this shard owns some)."""
    store: SyncerStore
    """The shard's durable state, restored and locked."""
    found: Restored | None
    """What the store held (None: a fresh folder)."""
    core: Syncer
    """The algorithm core holding this shard's values: the global model itself."""
    state_keys: dict[str, tuple[str, torch.dtype]]
    """The final model file's keys (see ``final_model.state_keys``): the syncer keeps no module."""
    spec: list[list[Any]]
    """[name, shape] of every synced tensor, as learners register it."""
    numel: int
    """Synced values in the whole model (N, for the data-parallel traffic baseline)."""


def check_shard(shard: int, num_shards: int) -> None:
    if not 0 <= shard < num_shards:
        raise DDiLoCoError(f"--shard {shard} is out of range for --num-shards {num_shards}; use 0 .. {num_shards - 1}")


def owned_fragments(layout: ModelLayout, shard: int, num_shards: int) -> list[int]:
    """The fragments shard ``shard`` of ``num_shards`` merges (round-robin); an error when none."""
    owned = [p for p in range(layout.num_fragments) if p % num_shards == shard]
    if not owned:
        raise DDiLoCoError(
            f"shard {shard} of {num_shards} owns no fragment (the model has {layout.num_fragments}); use fewer shards"
        )
    return owned


def restore_global(
    cfg: Config,
    run_dir: Path,
    shard: int,
    num_shards: int,
    fsync: bool,
    model: nn.Module | None,
    embedding_like: Callable[[str], bool] | None,
    take: bool = False,
) -> GlobalModel:
    """Open and restore the shard's store, then build its core from what it held (``model``:
    the initial global model; default the config's workload builds it, as its structure alone
    when every value comes from the store). ``take``: ``model``'s values are the core's to keep
    (its caller lets the model's tensors go: ``SyncerServer``), not copied."""
    wl = None
    if model is None:
        # The workload's model, first as its structure alone: a restart takes every value
        # from the store, and a fresh run builds the values once, below.
        wl = load_workload(cfg.workload)
        model = meta_model(wl, cfg.run.seed)
        embedding_like = embedding_like or wl.is_embedding_like
    layout = layout_of(model, cfg.algo, embedding_like or embedding_parameters(model))
    owned = owned_fragments(layout, shard, num_shards)
    # The syncer keeps no model: the core's values are the global model. What the final
    # model file needs of the module is the names of its state dict (tied weights are listed
    # twice) and their dtypes.
    keys = state_keys(model)
    spec, numel = param_spec(model), sum(t.numel() for t in synced_tensors(model).values())
    store = SyncerStore(run_dir, shard, num_shards, fsync=fsync, log_bound=cfg.runtime.store_log_bound)
    found = store.restore(layout.fragments, owned)
    if wl is not None and next(iter(synced_tensors(model).values())).is_meta:
        if found is not None and set(found.fragments) >= set(owned):
            # every fragment comes from the store: placeholders (untouched memory) stand in
            model = model.to_empty(device="cpu")
        else:
            model = wl.build_model(cfg.run.seed)  # a fresh run (or a fragment never merged)
    params = synced_tensors(model)  # the parameters and the persistent buffers
    # values this process built, or a model given in code that its caller lets go, are the core's to keep
    # The drift sketches' signs: drawn anew at each start, told to no learner (robust.Sketch).
    seed = secrets.randbits(62)
    core = Syncer(
        cfg.algo, layout.fragments, params, layout.embedding_like, owned, take=take or wl is not None, sketch_seed=seed
    )
    return GlobalModel(layout, store, found, core, keys, spec, numel)


def open_session(
    cfg: Config, g: GlobalModel, run_dir: Path, clock: Clock, start: float, shard: int, keyed: bool
) -> tuple[SyncerSession, str | None]:
    """The shard's session over ``g``'s core, with what the store and the run log hold: the
    session, and why the run already ended (None: it goes on)."""
    started_at = run_started_at(run_dir) or clock.wall()
    runlog = [r for r in read_jsonl(run_dir / "metrics" / "run.jsonl") if r.get("what") != "start"]
    last = runlog[-1] if runlog and runlog[-1].get("what") == "end" else None
    ended = None if last is None else str(last.get("reason", "the run ended"))
    session = SyncerSession(
        g.core,
        cfg.runtime,
        budget_of(cfg),
        # What learners must match: the model, its layout, and the run's settings (sent to a
        # learner given no config, checked against one given a config).
        Registration(g.spec, g.layout.digest, settings=said(run_settings(cfg))),
        start,
        shard=shard,
        # A new value per start: learners see the syncer restarted and register again.
        epoch=secrets.randbits(62),
        # The run's age: the wall clock is read once here (a restart resumes the count), then
        # only the monotonic clock advances it, so a wall-clock jump moves no decision.
        age_s=max(0.0, clock.wall() - started_at),
        ended=ended,
        keyed=keyed,
        num_learners=cfg.run.num_learners,  # the cap on learner ids, with or without keys
        run=secrets.token_hex(8),  # a fresh run's identity; a restored store's replaces it
    )
    if g.found is not None:
        session.restore(g.found.fragments, g.found.syncer_meta, take=True)  # (the store's own tensors)
    if last is not None and isinstance(last.get("processed_tokens"), (int, float)):
        session.ended_at(float(last["processed_tokens"]))
    if ended is not None and (why := session.reopen(start)) is not None:
        log.warning("%s", why)  # one line: why it stopped, and why it goes on
        ended = None
    return session, ended


def meta_model(wl: Any, seed: int) -> nn.Module:
    """The workload's model as its structure alone (on the meta device: no memory, no init), or
    the model itself where the workload cannot build it there."""
    try:
        with torch.device("meta"):
            model: nn.Module = wl.build_model(seed)
        if all(t.is_meta for t in synced_tensors(model).values()):
            return model
    except Exception as e:  # a workload's own code: any failure means "build it for real"
        log.debug("the workload's model does not build on the meta device (%s): building it", e)
    built: nn.Module = wl.build_model(seed)
    return built
