"""``ddiloco status ADDR|RUN_DIR``: the fleet at a glance, from a live syncer or a run folder.

From an address it asks the syncer as an observer (``service/base/observer.py``: a ``StatusRequest``,
``observer.key_secret`` with ``--keys``, a bounded wait for the ``StatusReply``). From a run
folder it reads every shard's status/syncer-K.json. Either way it merges the shards' views into
one and prints two tables (learners, fragments), or the dict with ``--json``; ``--watch``
refreshes it until Ctrl-C.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from ddiloco.errors import DDiLoCoError
from ddiloco.report.summary import byte_size
from ddiloco.service.base.keys import ClientKeys
from ddiloco.service.base.observer import fetch_status, observer_keys
from ddiloco.service.base.status import read_status

TERMS = "docs/operations.md#terms"
_RANK = {"up": 2, "left": 1, "down": 0}


def is_address(target: str) -> bool:
    return "://" in target


def read_run_dir(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every shard's last status file in ``run_dir`` (DDiLoCoError when there is none)."""
    d = Path(run_dir)
    if not d.is_dir():
        raise DDiLoCoError(f"{run_dir} is neither a run folder nor an address (write a syncer as tcp://HOST:PORT)")
    views = [v for p in sorted(d.glob("status/syncer-*.json")) if (v := read_status(p)) is not None]
    if not views:
        raise DDiLoCoError(f"{run_dir} has no status/syncer-*.json: has a syncer run on this folder yet?")
    return views


def merge_views(views: list[dict[str, Any]]) -> dict[str, Any]:
    """One view of several shards: a learner's figures are the freshest any shard has (its
    versions behind add up over the shards), fragments are listed together."""
    if len(views) == 1:
        return views[0]
    learners: dict[int, dict[str, Any]] = {}
    for v in views:
        for entry in v.get("learners", []):
            cur = learners.get(entry["learner"])
            if cur is None:
                learners[entry["learner"]] = dict(entry)
                continue
            if _RANK.get(entry["state"], 0) > _RANK.get(cur["state"], 0):
                cur["state"] = entry["state"]
            for k in ("step", "tokens", "busy_s", "bytes_sent", "steps_per_s"):
                cur[k] = _pick(max, cur.get(k), entry.get(k))
            for k in ("heard_age_s", "contribution_age_s"):
                cur[k] = _pick(min, cur.get(k), entry.get(k))
            if entry.get("loss") is not None and (cur.get("loss") is None or _fresher(entry, cur)):
                cur["loss"] = entry["loss"]
            cur["behind"] = _pick(lambda a, b: a + b, cur.get("behind"), entry.get("behind"))
            for k in ("up_bytes_per_step", "down_bytes_per_step"):  # each shard sees its own link's bytes
                if k in cur or k in entry:
                    cur[k] = _pick(lambda a, b: a + b, cur.get(k), entry.get(k))
    n_frag = [max(1, v.get("fragments_total", 1)) for v in views]
    return {
        "shards": sorted(v.get("shard", 0) for v in views),
        "time": max(v.get("time", 0.0) for v in views),
        "run_time_s": max(v.get("run_time_s", 0.0) for v in views),
        "merged_tokens": sum(v.get("merged_tokens", 0.0) * n for v, n in zip(views, n_frag)) / sum(n_frag),
        # every shard hears every learner's heartbeats: each counts the whole fleet's processed tokens;
        # once the run ended, shard 0's is the count in its end record and the summary
        "processed_tokens": next(
            (v.get("processed_tokens", 0.0) for v in views if v.get("shard", 0) == 0 and v.get("run_end")),
            max(v.get("processed_tokens", 0.0) for v in views),
        ),
        "learners_total": max(v.get("learners_total", 0) for v in views),
        # shard 0 keeps the learners' books
        "goodput": next((v["goodput"] for v in views if isinstance(v.get("goodput"), (int, float))), None),
        "fragments_total": sum(v.get("fragments_total", 0) for v in views),
        "learners": [learners[m] for m in sorted(learners)],
        "fragments": sorted((f for v in views for f in v.get("fragments", [])), key=lambda f: f["fragment"]),
        **_merged_traffic([v["traffic"] for v in views if isinstance(v.get("traffic"), dict)]),
        # each shard is a process of its own: its memory apart
        "memory_by_shard": {
            str(v.get("shard", k)): v["memory"] for k, v in enumerate(views) if isinstance(v.get("memory"), dict)
        },
    }


def _merged_traffic(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The shards' traffic figures as one: bytes per learner per step and one-off bytes add up
    over the shards' links, the data-parallel baseline is the run's, the ratios follow."""
    if not parts:
        return {}
    out: dict[str, Any] = {}
    for k in ("up_bytes_per_step", "down_bytes_per_step", "one_off_up_bytes", "one_off_down_bytes"):
        values = [p[k] for p in parts if isinstance(p.get(k), (int, float))]
        out[k] = sum(values) if values else None
    for k in ("params", "learners", "dp_bytes_per_step", "steps"):
        out[k] = max((p[k] for p in parts if p.get(k) is not None), default=None)
    for d in ("up", "down"):
        mine, dp = out[f"{d}_bytes_per_step"], out["dp_bytes_per_step"]
        out[f"dp_ratio_{d}"] = dp / mine if dp is not None and mine else None
    return {"traffic": out}


def _pick(fn: Callable[[Any, Any], Any], a: Any, b: Any) -> Any:
    return b if a is None else a if b is None else fn(a, b)


def _fresher(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a.get("heard_age_s") or math.inf) < (b.get("heard_age_s") or math.inf)


# -- showing it ---------------------------------------------------------------------------------


def _age(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.1f} s ago" if s < 120 else f"{s / 60:.1f} min ago" if s < 7200 else f"{s / 3600:.1f} h ago"


def _opt(v: Any, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def render(view: dict[str, Any], source: str) -> Any:
    """Two rich tables (learners, fragments) and the line that says where the figures are from."""
    from rich.console import Group
    from rich.table import Table

    learners, fragments = view.get("learners", []), view.get("fragments", [])
    up = sum(1 for ln in learners if ln["state"] == "up")
    total, ftotal = view.get("learners_total", len(learners)), view.get("fragments_total", len(fragments))
    lt = Table(
        title=f"learners: {up} up of {total} - tokens processed {view.get('processed_tokens', 0):,.0f}, merged "
        f"{view.get('merged_tokens', 0):,.0f} - run time {view.get('run_time_s', 0):,.0f} s"
        + (f" - goodput {view['goodput']:.1%}" if isinstance(view.get("goodput"), (int, float)) else ""),
        caption=f"terms: {TERMS}" + (f" ({len(learners)} of {total} listed)" if len(learners) < total else ""),
    )
    for col in ("learner", "state", "step", "tokens", "steps/s", "loss", "busy", "sent", "up/step", "down/step",
                "last contribution", "behind"):  # fmt: skip
        lt.add_column(col, justify="left" if col == "state" else "right")
    for ln in learners:
        lt.add_row(
            str(ln["learner"]),
            ln["state"],
            f"{ln.get('step', 0):,}",
            f"{ln.get('tokens', 0):,}",
            _opt(ln.get("steps_per_s"), "{:.2f}"),
            _opt(ln.get("loss"), "{:.4f}"),
            f"{ln.get('busy_s', 0.0):,.0f} s",
            byte_size(ln.get("bytes_sent", 0)),
            _opt_bytes(ln.get("up_bytes_per_step")),
            _opt_bytes(ln.get("down_bytes_per_step")),
            _age(ln.get("contribution_age_s")),
            _opt(ln.get("behind"), "{}"),
        )
    ft = Table(
        title=f"fragments: {ftotal}",
        caption=f"terms: {TERMS}" + (f" ({len(fragments)} of {ftotal} listed)" if len(fragments) < ftotal else ""),
    )
    for col in ("fragment", "version", "last merge", "merged", "grace", "tokens merged"):
        ft.add_column(col, justify="right")
    for f in fragments:
        ft.add_row(
            str(f["fragment"]),
            str(f["version"]),
            _age(f.get("merge_age_s")),
            str(f.get("merged", 0)),
            f"{f.get('grace_s', 0.0):.2f} s",
            f"{f.get('tokens_merged', 0):,}",
        )
    return Group(lt, ft, traffic_line(view.get("traffic")), memory_line(view), source)


def _opt_bytes(n: float | None) -> str:
    return "-" if n is None else byte_size(n)


def traffic_line(traffic: dict[str, Any] | None) -> str:
    """The link's traffic in one line: steady bytes per learner per inner step, up and down, and
    how many times fewer than data-parallel's fp32 ring all-reduce; one-off bytes beside."""
    if not traffic:
        return "traffic: not counted yet"
    ratios = [traffic.get("dp_ratio_up"), traffic.get("dp_ratio_down")]
    versus = (
        f"; data-parallel fp32 {byte_size(traffic['dp_bytes_per_step'])}/step: "
        + " / ".join("-" if r is None else f"{r:,.1f}x fewer" for r in ratios)
        if traffic.get("dp_bytes_per_step")
        else ""
    )
    return (
        f"traffic per learner per inner step (steady state): up {_opt_bytes(traffic.get('up_bytes_per_step'))}, "
        f"down {_opt_bytes(traffic.get('down_bytes_per_step'))}{versus}; one-off up "
        f"{_opt_bytes(traffic.get('one_off_up_bytes'))}, down {_opt_bytes(traffic.get('one_off_down_bytes'))}"
    )


MEMORY = (
    ("held_values", "values"), ("held_momentum", "momentum"), ("held_chain", "served copy"),
    ("held_past", "past versions"), ("held_pending", "open rounds"), ("held_scratch", "merge buffers"),
    ("held_drift", "drift history"),
    ("unowned", "other shards' fragments"), ("model", "model given"), ("eval_copy", "evaluation copy"),
    ("send_queued", "send queues"),
)  # fmt: skip
"""The status ``memory`` figures a status shows, in order, with their names there (a zero is left out)."""


def memory_line(view: dict[str, Any]) -> str:
    """Each shard's memory in one line: what it holds by purpose (the core's, then beside it),
    its resident size now and its peak, with the phase the peak was reached in."""
    per = view.get("memory_by_shard")
    if not isinstance(per, dict):
        per = {str(view.get("shard", 0)): view["memory"]} if isinstance(view.get("memory"), dict) else {}
    if not per:
        return "memory: not reported"
    lines = []
    for shard, mem in sorted(per.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0):
        held = ", ".join(
            f"{name} {byte_size(mem[k])}" for k, name in MEMORY if isinstance(mem.get(k), (int, float)) and mem[k]
        )
        peak = (
            f", peak {byte_size(mem['rss_peak'])} (reached in: {mem.get('rss_peak_in') or '-'})"
            if mem.get("rss_peak")
            else ""
        )
        lines.append(f"memory (shard {shard}): {held or 'nothing held'}; resident {byte_size(mem.get('rss', 0))}{peak}")
    return "\n".join(lines)


def _clock(wall: float) -> str:
    return datetime.fromtimestamp(wall).strftime("%H:%M:%S")


class Source:
    """Where the figures come from: one or more shard addresses, or a run folder."""

    def __init__(self, targets: list[str], timeout_s: float, keys_dir: str | None, insecure: bool) -> None:
        self.addresses = [t for t in targets if is_address(t)]
        self.run_dir = None if self.addresses else targets[0]
        if self.addresses and len(self.addresses) != len(targets) or not self.addresses and len(targets) != 1:
            raise DDiLoCoError("give one run folder, or one address per syncer shard (tcp://HOST:PORT ...)")
        self.timeout_s = timeout_s
        self.keys: ClientKeys | None = observer_keys(self.addresses, keys_dir, insecure) if self.addresses else None

    def read(self) -> tuple[dict[str, Any], str]:
        """The merged view and the line saying where it is from (DDiLoCoError: nothing to show)."""
        if self.run_dir is not None:
            views = read_run_dir(self.run_dir)
            written = max(v.get("time", 0.0) for v in views)
            line = f"(from the run folder, last written {_clock(written)}, {max(0.0, time.time() - written):.0f} s ago)"
            return merge_views(views), line
        views = [fetch_status(addr, self.timeout_s, self.keys) for addr in self.addresses]  # NoReply says why not
        return merge_views(views), f"(live from {', '.join(self.addresses)} at {_clock(time.time())})"


def run_status(
    targets: list[str],
    watch: float | None = None,
    keys_dir: str | None = None,
    insecure: bool = False,
    as_json: bool = False,
    timeout_s: float = 5.0,
) -> int:
    """The ``ddiloco status`` command; returns its exit code (DDiLoCoError for a one-shot failure)."""
    from rich.console import Console

    if watch is not None and not (watch > 0 and math.isfinite(watch)):
        raise DDiLoCoError(f"--watch {watch}: the refresh interval must be > 0 seconds")
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise DDiLoCoError(f"--timeout {timeout_s}: must be > 0 seconds")
    source = Source(targets, timeout_s, keys_dir, insecure)
    console = Console() if sys.stdout.isatty() else Console(width=160)

    def show() -> Any:
        try:
            view, line = source.read()
        except DDiLoCoError as e:
            if watch is None:
                raise
            return None, str(e)
        return view, line

    if watch is None:
        view, line = show()
        if as_json:
            print(json.dumps(view, indent=2))
        else:
            console.print(render(view, line))
        return 0
    try:
        if console.is_terminal and not as_json:
            from rich.live import Live

            with Live(console=console, refresh_per_second=4, transient=False) as live:
                while True:
                    view, line = show()
                    live.update(render(view, line) if view is not None else line)
                    time.sleep(watch)
        while True:
            view, line = show()
            if as_json:
                print(json.dumps(view if view is not None else {"error": line}), flush=True)
            else:
                console.print(render(view, line) if view is not None else line)
                sys.stdout.flush()
            time.sleep(watch)
    except KeyboardInterrupt:
        return 0
