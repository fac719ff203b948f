"""A run's whole configuration: TOML file + ``--set key=value`` overrides -> frozen dataclasses.

Sections map one to one onto dataclasses: ``[run]`` RunSection, ``[workload]`` WorkloadConfig,
``[algo]`` DiLoCoConfig, ``[inner]`` InnerConfig, ``[sim]`` VirtualTimeConfig, ``[chaos]`` ChaosConfig.
Unknown keys and out-of-range values fail before any work starts, with one line.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ddiloco.chaos.schedule import ChaosConfig
from ddiloco.core.config import DiLoCoConfig
from ddiloco.errors import ConfigError, UsageError, require, require_one_of
from ddiloco.protocol.config import RuntimeConfig
from ddiloco.training.inner import InnerConfig
from ddiloco.workloads.config import WorkloadConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

Method = Literal["dp", "diloco", "streaming", "decoupled"]
SimBudget = Literal["tokens", "time"]
METHODS: tuple[Method, ...] = typing.get_args(Method)
BUDGETS: tuple[SimBudget, ...] = typing.get_args(SimBudget)


@dataclass(frozen=True)
class RunSection:
    """What to run and for how long."""

    method: Method = "decoupled"
    """dp (data-parallel reference), diloco (synchronous), streaming, or decoupled."""
    num_learners: int = 4
    """M, the number of learners."""
    processed_tokens: int = 600_000
    """The token budget N: tokens processed by the whole fleet (every learner and incarnation,
    work lost in failures included). A run ends once the fleet has processed them (a real run:
    as the syncer counts them from the learners' heartbeats; ``runtime.duration_s`` may end it
    sooner), so every method is compared at equal tokens processed. The inner LR schedule runs
    over the same count (``Learner.fleet_tokens``), and it fixes the virtual-time budget T: the
    time a healthy fleet at speed 1 needs for N tokens."""
    merged_tokens: int = 0
    """A second, optional budget: end the run once this many tokens are merged into the global
    model (the mean over fragments of the tokens their merges took in); 0: none."""
    budget: SimBudget = "tokens"
    """When a simulated run ends: "tokens" once the fleet has processed N tokens, however long
    that takes (lock-step waits and slow learners take longer; every method is compared at
    equal tokens); "time" at T, with whatever tokens faults and waits left (goodput studies).
    Either way a final sync then merges every live learner's remaining progress."""
    seed: int = 0
    """Seed of the model init; data, chaos and speed noise derive their own streams from it."""
    eval_points: int = 8
    """Evaluations of the global model spread over the run (plus the final one)."""
    run_dir: str = "runs/latest"
    """Folder for config, metrics, tape, plot and final model. A path named ``latest`` (the
    default) makes ``train`` and ``simulate`` start a fresh ``METHOD-YYYYmmdd-HHMMSS`` folder
    next to it and point ``latest`` at it; any other path is used as it is (like ``--run-dir``)."""
    threads: int = 1
    """torch.set_num_threads for this process."""

    if not typing.TYPE_CHECKING:  # (type checkers still flag a name the section lacks)

        def __getattr__(self, name: str) -> Any:
            # Reached only for a name the section lacks: one of an earlier version reads its new
            # name for one release, and says so.
            if f"run.{name}" not in RENAMED:
                raise AttributeError(f"'RunSection' object has no attribute {name!r}")
            new = RENAMED[f"run.{name}"][0]
            warnings.warn(f"{renamed_line(f'run.{name}')}: read {new}", DeprecationWarning, stacklevel=2)
            return getattr(self, new.split(".", 1)[1])


@dataclass(frozen=True)
class VirtualTimeConfig:
    """The virtual-time cost model."""

    step_time_s: float = 1.0
    """Virtual seconds of one inner step of a speed-1 learner."""
    speeds: tuple[float, ...] = ()
    """Per-learner speed factors (1 = nominal, 0.8 = 20% slower); empty: all 1."""
    speed_noise: float = 0.0
    """Relative standard deviation of each step's duration (own seeded stream)."""
    bandwidth_gbps: float = 1.0
    """Learner <-> syncer bandwidth, gigabits per second."""
    latency_s: float = 0.005
    """One-way message latency."""
    jitter_s: float = 0.002
    """Mean of an exponential extra delay on every message (own seeded stream), so equal
    transfers do not arrive in learner-id order."""
    merge_gbps: float = 8.0
    """Syncer merge throughput, gigabytes of contributions per second."""
    syncer_shards: int = 1
    """Syncer shards (fragment p is owned by shard p mod shards), each with its own store."""


@dataclass(frozen=True)
class Config:
    """Everything a run needs."""

    run: RunSection = field(default_factory=RunSection)
    """[run]"""
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    """[workload]"""
    algo: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    """[algo]"""
    inner: InnerConfig = field(default_factory=InnerConfig)
    """[inner]"""
    sim: VirtualTimeConfig = field(default_factory=VirtualTimeConfig)
    """[sim]"""
    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    """[chaos]"""
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    """[runtime]"""

    def validate(self) -> Config:
        r = self.run
        require_one_of("run.method", r.method, METHODS)
        require_one_of("run.budget", r.budget, BUDGETS)
        for name, ok, allowed in (
            ("num_learners", r.num_learners >= 1, ">= 1"),
            ("processed_tokens", r.processed_tokens >= 1, ">= 1"),
            ("merged_tokens", r.merged_tokens >= 0, ">= 0 (0: no merged-token budget)"),
            ("eval_points", r.eval_points >= 0, ">= 0"),
            ("threads", r.threads >= 1, ">= 1"),
        ):
            require(ok, f"run.{name}", getattr(r, name), allowed)
        i = self.inner
        for name, ok, allowed in (
            ("lr", i.lr > 0, "> 0"),
            ("weight_decay", i.weight_decay >= 0, ">= 0"),
            ("beta1", 0 <= i.beta1 < 1, "[0, 1)"),
            ("beta2", 0 <= i.beta2 < 1, "[0, 1)"),
            ("warmup_frac", 0 <= i.warmup_frac < 1, "[0, 1)"),
            ("min_lr_frac", 0 <= i.min_lr_frac <= 1, "[0, 1]"),
            ("grad_clip", i.grad_clip >= 0, ">= 0"),
        ):
            require(ok, f"inner.{name}", getattr(i, name), allowed)
        s = self.sim
        for name, ok, allowed in (
            ("step_time_s", s.step_time_s > 0, "> 0"),
            ("speed_noise", 0 <= s.speed_noise < 1, "[0, 1)"),
            ("bandwidth_gbps", s.bandwidth_gbps > 0, "> 0"),
            ("latency_s", s.latency_s >= 0, ">= 0"),
            ("jitter_s", s.jitter_s >= 0, ">= 0"),
            ("merge_gbps", s.merge_gbps > 0, "> 0"),
            ("syncer_shards", s.syncer_shards >= 1, ">= 1"),
        ):
            require(ok, f"sim.{name}", getattr(s, name), allowed)
        if s.speeds and (len(s.speeds) != r.num_learners or min(s.speeds) <= 0):
            raise ConfigError(
                f"sim.speeds = {list(s.speeds)} must list {r.num_learners} positive factors (one per learner) or be "
                "empty"
            )
        rt = self.runtime
        for name in (
            "heartbeat_interval_s",
            "syncer_liveness_s",
            "backoff_initial_s",
            "backoff_max_s",
            "join_timeout_s",
            "snapshot_interval_s",
            "eval_interval_s",
            "duration_s",
            "status_interval_s",
            "metrics_interval_s",
        ):
            require(getattr(rt, name) > 0, f"runtime.{name}", getattr(rt, name), "> 0")
        for name in ("max_joins_per_s", "max_messages_per_s", "max_rejections_logged_per_s"):
            require(getattr(rt, name) > 0, f"runtime.{name}", getattr(rt, name), "> 0")
        require(
            type(rt.syncer_threads) is int and 0 <= rt.syncer_threads <= 1024,
            "runtime.syncer_threads", rt.syncer_threads, "an integer in [0, 1024] (0: every core it may use)",
        )  # fmt: skip
        require(1 <= rt.store_log_bound < 1e6, "runtime.store_log_bound", rt.store_log_bound, ">= 1 (records), finite")
        require(
            0 <= rt.eval_every_tokens < 1e18,
            "runtime.eval_every_tokens", rt.eval_every_tokens, ">= 0 merged tokens (0: automatic), finite",
        )  # fmt: skip
        require(
            type(rt.max_pending_connections) is int and 0 <= rt.max_pending_connections <= 1 << 20,
            "runtime.max_pending_connections", rt.max_pending_connections,
            "an integer in [0, 1048576] (0: no bound but ZeroMQ's)",
        )  # fmt: skip
        require(
            0.1 <= rt.pending_connection_s <= 3600, "runtime.pending_connection_s", rt.pending_connection_s,
            "in [0.1, 3600] seconds",
        )  # fmt: skip
        require(1 <= rt.token_rate_spread < 1e9, "runtime.token_rate_spread", rt.token_rate_spread, ">= 1, finite")
        require(0 < rt.lone_tokens_per_s < 1e18, "runtime.lone_tokens_per_s", rt.lone_tokens_per_s, "> 0, finite")
        require(rt.local_state_max_age_s > 0, "runtime.local_state_max_age_s", rt.local_state_max_age_s, "> 0")
        for name in (
            "send_queue_mb", "peer_state_chunk_mb", "peer_state_buffer_mb", "local_state_chunk_mb",
            "local_state_buffer_mb",
        ):  # fmt: skip
            require(0 < getattr(rt, name) < 1 << 30, f"runtime.{name}", getattr(rt, name), "> 0 MiB, finite")
        for name in ("peer_state_copy_share", "local_state_copy_share"):
            share = getattr(rt, name)
            require(0 < share <= 1, f"runtime.{name}", share, "in (0, 1]: a share of a step")
        for name in (
            "restart_limit", "restart_delay_s", "step_sleep_s", "end_linger_s", "progress_interval_s", "record_mb",
            "give_up_after_s", "give_up_spent_s", "local_state_s",
        ):  # fmt: skip
            require(getattr(rt, name) >= 0, f"runtime.{name}", getattr(rt, name), ">= 0")
        if rt.metrics_bind:
            host, _, port = rt.metrics_bind.rpartition(":")
            require(bool(host) and port.isdigit() and int(port) < 65536, "runtime.metrics_bind", rt.metrics_bind,
                    "HOST:PORT (e.g. 0.0.0.0:9400; port 0: any free one), or empty for none")  # fmt: skip
        if rt.heartbeat_interval_s >= self.algo.liveness_timeout_s:
            raise ConfigError(
                f"runtime.heartbeat_interval_s = {rt.heartbeat_interval_s} must be below algo.liveness_timeout_s = "
                f"{self.algo.liveness_timeout_s}, or every learner looks dead"
            )
        if self.algo.takeover_after_s < 2 * rt.heartbeat_interval_s:
            raise ConfigError(
                f"algo.takeover_after_s = {self.algo.takeover_after_s} must be at least 2 x "
                f"runtime.heartbeat_interval_s = {2 * rt.heartbeat_interval_s}, or a live learner's id can be "
                "taken over"
            )
        self.algo.validate()
        self.workload.validate()
        self.chaos.validate(r.num_learners)
        if (self.algo.quorum_size or 0) > r.num_learners:
            import warnings

            warnings.warn(
                f"algo.quorum = {self.algo.quorum} exceeds run.num_learners = {r.num_learners}; the effective "
                "quorum is capped at the live learners (the fleet is elastic)",
                stacklevel=2,
            )
        return self


# -- loading ---------------------------------------------------------------------------------


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert a TOML/CLI value to the annotated field type, or fail naming the key."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        # A few allowed values: the loader checks them itself, so that no Literal field can
        # slip through a validate() that forgot it.
        require_one_of(where, value, typing.get_args(tp))
        return value
    if origin in (typing.Union, types.UnionType) and _int_or_keyword(tp):
        return _coerce_int_or_keyword(value, where)
    try:
        return _convert(value, tp, origin, where)
    except (TypeError, ValueError):
        raise ConfigError(f"{where} = {value!r} is not a valid {getattr(tp, '__name__', tp)}") from None


def _coerce_int_or_keyword(value: Any, where: str) -> Any:
    """An "int or a keyword" field (num_fragments = "auto", quorum = "all"); a word that is not
    the keyword is left to the section's validate(), which says what the number may be."""
    if isinstance(value, bool):
        raise ConfigError(f"{where} = {value!r} is not a valid integer or keyword")
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return value


def _convert(value: Any, tp: Any, origin: Any, where: str) -> Any:
    """``value`` as the plain type ``tp`` (bool, int, float, str, a tuple or a dict; anything
    else as it is); TypeError or ValueError when it is not one."""
    if tp is bool:
        return _to_bool(value)
    if tp is int:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError
        return int(float(value)) if isinstance(value, str) else int(value)
    if tp is float:
        return float(value)
    if tp is str:
        return str(value)
    if origin is tuple:
        (inner, _ell) = typing.get_args(tp)
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()]
        return tuple(_coerce(v, inner, where) for v in value)
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError
        return dict(value)
    return value


def _to_bool(value: Any) -> bool:
    if isinstance(value, str):
        if value.lower() in ("true", "1", "yes", "on"):
            return True
        if value.lower() in ("false", "0", "no", "off"):
            return False
        raise ValueError
    return bool(value)


RENAMED: dict[str, tuple[str, str]] = {
    "run.tokens": (
        "run.processed_tokens",
        "tokens the whole fleet processes: the budget every method is compared at and the LR schedule's horizon; "
        "a budget of tokens merged into the global model is run.merged_tokens",
    ),
}
"""Keys of earlier versions -> (the key they became, what it means). For one release a config
that uses one is read as the new key with a WARNING line (both at once is an error); the
attribute (``cfg.run.tokens``) reads the new one with a ``DeprecationWarning``."""


def renamed_line(old: str) -> str:
    """What an earlier version's key became, in one line."""
    new, meaning = RENAMED[old]
    return f"{old} is now {new} ({meaning})"


def _int_or_keyword(tp: Any) -> bool:
    """Whether ``tp`` is ``int | str`` or ``int | Literal[...]`` (of strings)."""
    args = typing.get_args(tp)
    if int not in args:
        return False
    others = [a for a in args if a is not int]
    return bool(others) and all(
        a is str or (typing.get_origin(a) is Literal and all(isinstance(v, str) for v in typing.get_args(a)))
        for a in others
    )


def _build(cls: type, data: dict[str, Any], section: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if f"{section}.{key}" in RENAMED:  # an earlier version's name: read as its new one, for one release
            old, new = f"{section}.{key}", RENAMED[f"{section}.{key}"][0]
            if new.split(".", 1)[1] in data:
                raise ConfigError(f"{old} and {new} are both set: {old} is {new}'s earlier name; keep {new} only")
            logging.getLogger(__name__).warning(
                "%s; it is read as %s for this release: rename the key", renamed_line(old), new
            )
            key = new.split(".", 1)[1]
        if key not in names:
            raise ConfigError(f"unknown config key {section}.{key}; known keys: {', '.join(sorted(names))}")
        kwargs[key] = _coerce(value, hints[key], f"{section}.{key}")
    return cls(**kwargs)


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"--set {text!r} must look like section.key=value (e.g. algo.quorum=2)")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2:
        raise ConfigError(f"--set {text!r}: the key must be section.key (e.g. run.num_learners=8)")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word, e.g. algo.merge=mean
    return parts, value


SECTIONS = {
    "run": RunSection,
    "workload": WorkloadConfig,
    "algo": DiLoCoConfig,
    "inner": InnerConfig,
    "sim": VirtualTimeConfig,
    "chaos": ChaosConfig,
    "runtime": RuntimeConfig,
}


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, base: dict[str, dict[str, Any]] | None = None
) -> Config:
    """Defaults <- ``base`` (e.g. a method preset) <- TOML file <- ``--set`` overrides."""
    data: dict[str, dict[str, Any]] = {k: dict(v) for k, v in (base or {}).items()}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist; pass an existing TOML file")
        try:
            file_data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
        for sec, vals in file_data.items():
            if sec not in SECTIONS or not isinstance(vals, dict):
                raise ConfigError(f"unknown config section [{sec}] in {p}; known: {', '.join(SECTIONS)}")
            data.setdefault(sec, {}).update(vals)
    for text in overrides or []:
        (sec, key), value = _parse_override(text)
        if sec not in SECTIONS:
            raise ConfigError(f"unknown config section {sec!r} in --set {text!r}; known: {', '.join(SECTIONS)}")
        data.setdefault(sec, {})[key] = value
    sections = {sec: _build(cls, data.get(sec, {}), sec) for sec, cls in SECTIONS.items()}
    return Config(**sections).validate()


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """The resolved config as plain TOML-able data."""
    out = {}
    for f in dataclasses.fields(cfg):
        sec = dataclasses.asdict(getattr(cfg, f.name))
        out[f.name] = {k: list(v) if isinstance(v, tuple) else v for k, v in sec.items()}
    return out


ConfigLike = Config | DiLoCoConfig | str | Path | None
"""A whole ``Config``, only its algorithm section, a TOML file shared with ``ddiloco syncer``,
or None for the defaults."""


def as_config(config: ConfigLike) -> Config:
    """Any accepted form of ``config`` as a validated ``Config`` (one line when it is not one)."""
    if config is None:
        return Config().validate()
    if isinstance(config, Config):
        return config.validate()
    if isinstance(config, DiLoCoConfig):
        return Config(algo=config).validate()
    if isinstance(config, (str, Path)):
        return load_config(config)
    raise UsageError(
        f"config must be a ddiloco Config, a DiLoCoConfig, a TOML file path or None, not a {type(config).__name__}"
    )
