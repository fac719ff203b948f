"""A learner's own saved state on its machine, for the next process of the same learner: a save
spread over step boundaries and written by a thread of its own (``LocalStateSaver``), and the
checked read of the last complete save (``read_local_state``).

A save is a folder: ``meta.json`` (format, who saved it, when, its counters), ``session``
(``protocol/local_state.LocalState``'s base copies and residuals, and the RNG), then the model's
synced tensors and the optimizer's state in pieces of ``runtime.local_state_chunk_mb``. It is
written as ``saving/`` and renamed to ``current/`` only once complete (a crash leaves the last
complete save, or ``previous/`` during the rename).

What a save holds is consistent where it must be: the versions, base copies and counters are
taken at one boundary, before any model piece is copied. A fragment that moves after that
boundary is behind in the save (its newer values may be in the model pieces), so a restart
takes it again from the syncer, by the chain's changes or in full; a fragment that did not move
keeps the progress the model pieces hold. Each parameter's optimizer state is of one step.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import shutil
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ddiloco.protocol.config import RuntimeConfig
from ddiloco.protocol.learner_session import LearnerSession
from ddiloco.protocol.local_state import MAX_COUNT, LocalState, capture
from ddiloco.protocol.messages import RUN_ID_LEN, PeerState
from ddiloco.service.base.durable import fsync_dir
from ddiloco.service.base.heap import release_free_memory
from ddiloco.service.learner.saved_files import SavedTensors, Tensors, spec_of
from ddiloco.training.peer_state import StateServer

log = logging.getLogger(__name__)

FORMAT = 1
"""The saved state's format (``meta.json``'s ``format``): a save of another is not taken back."""
META_MAX_BYTES = 4 << 20
"""Most bytes of a ``meta.json`` read back (its counters grow with the fragments, not the model)."""
MAX_FILES = 100_000
"""Most piece files a save may list."""


@dataclass
class Saved:
    """A complete save, read back and checked for its form (``read_local_state``); whether it
    fits the learner's model, optimizer and session is checked where it is taken back."""

    state: LocalState
    """The session's part."""
    model: Tensors
    """The model's synced tensors by name (CPU; read from their files as they are taken)."""
    optimizer: Tensors
    """The optimizer's state as the hand-off's pieces name it (a large tensor by ranges of rows,
    put together by ``take_back``); empty: the learner saved none."""
    rng: torch.Tensor | None
    """The CPU RNG's state."""
    data_position: int
    """Where its data resumes."""
    age_s: float
    """How long ago it was saved (wall clock)."""


def _save_file(tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    with open(path, "rb") as f:
        os.fsync(f.fileno())


class LocalStateSaver:
    """Saves a learner's state: a save starts ``interval_s`` after the last one ended, or sooner
    once a fragment has moved ``versions_behind`` versions past the last save (a restart then
    still catches up by the syncer's chain), but not sooner than a quarter of ``interval_s``
    after it. Its pieces are copied at step boundaries (``boundary``, on the training thread),
    each boundary spending about ``copy_share`` of the last step on copies and holding at most
    ``buffer_bytes`` copied and not yet written; a thread of its own writes them. A failed write
    costs one log line and that save; training never waits for the disk."""

    def __init__(
        self,
        folder: Path,
        learner: int,
        layout: str,
        params: Mapping[str, torch.Tensor],
        optimizer: torch.optim.Optimizer | None,
        interval_s: float,
        chunk_bytes: int,
        copy_share: float = 0.02,
        buffer_bytes: int = 256 << 20,
        versions_behind: int = 0,
    ) -> None:
        self.folder, self.learner, self.layout = folder, learner, layout
        self.params, self.optimizer = params, optimizer
        self.interval_s, self.chunk_bytes = interval_s, max(1, chunk_bytes)
        self.copy_share, self.buffer_bytes = copy_share, max(1, buffer_bytes)
        self.versions_behind = versions_behind
        """0: only the interval starts a save (no chain: an fp32 down-link)."""
        self.saves = 0
        """Complete saves written by this process."""
        self.copy_s = 0.0
        """Seconds the boundaries spent copying pieces (the save's cost on the step path)."""
        self.longest_copy_s = 0.0
        """The longest one boundary spent copying."""
        self.boundaries = 0
        """Step boundaries that had a save under way to copy (after the one that began it)."""
        self.last_save: dict[str, float] = {}
        """The last complete save: when it ``began`` (its state's time) and when it was ``done``
        (wall clock; between them, what a restart would have taken back is the one before)."""
        self._ended_at = time.monotonic()
        self._saved_versions: list[int] | None = None
        """The versions of the last save begun (None: none yet)."""
        self._last_boundary: float | None = None
        self._pieces: Iterator[tuple[str, dict[str, torch.Tensor]]] | None = None
        self._jobs: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        self._pending = 0
        """Bytes copied and not yet written (the writer lowers it)."""
        self._pending_lock = threading.Lock()
        self._writing = threading.Event()
        """Set while a save's jobs are queued or being written (cleared once its last is done)."""
        self._failed = False
        self._thread = threading.Thread(target=self._write_all, name=f"ddiloco-save-{learner}", daemon=True)
        self._thread.start()

    def due(self, session: LearnerSession, now: float) -> bool:
        """Whether a save should start at this boundary."""
        if self._writing.is_set() or not session.joined_once:
            return False
        since = now - self._ended_at
        if since >= self.interval_s:
            return True
        if self.versions_behind <= 0 or self._saved_versions is None or since < self.interval_s / 4:
            return False
        moved = max(v - s for v, s in zip(session.core.base_version, self._saved_versions))
        return moved >= self.versions_behind

    def boundary(self, session: LearnerSession, data_position: int) -> None:
        """At a step boundary: start a save when one is due, or copy its next pieces (about
        ``copy_share`` of the last step, at least one, while the unwritten ones fit the buffer)."""
        now = time.monotonic()
        step_s, self._last_boundary = (now - self._last_boundary if self._last_boundary else 0.0), now
        if self._pieces is None:
            if self.due(session, now):
                self._begin(session, data_position)
            return
        t0 = time.perf_counter()
        copied = 0
        if self._failed:  # the writer gave this save up: copy nothing more of it
            self._pieces = None
            self._submit(("finish", None), 0)
        budget_s = self.copy_share * step_s
        while self._pieces is not None and self._pending < self.buffer_bytes:
            if copied and time.perf_counter() - t0 >= budget_s:
                break
            piece = next(self._pieces, None)
            if piece is None:
                self._pieces = None
                self._submit(("finish", None), 0)
                break
            n = sum(t.numel() * t.element_size() for t in piece[1].values())
            self._submit(("piece", piece), n)
            copied += 1
        took = time.perf_counter() - t0
        self.copy_s += took
        self.longest_copy_s = max(self.longest_copy_s, took)
        self.boundaries += 1

    def _begin(self, session: LearnerSession, data_position: int) -> None:
        """The save's consistent part, taken now: the session's state (its tensors are never
        written in place: no copy) and the counters."""
        state = capture(session)
        self._saved_versions = list(state.versions)
        self._writing.set()
        meta = {
            "format": FORMAT, "learner": self.learner, "layout": self.layout, "saved_at": time.time(),
            "data_position": data_position, "versions": list(state.versions), "steps": list(state.steps),
            "tokens": list(state.tokens), "step": state.step, "merged_tokens": state.merged_tokens,
            "fleet": state.fleet, "runs": list(state.runs), "model": [], "optimizer": [],
        }  # fmt: skip
        session_tensors = {f"base.{p}.{i}": v for p, vals in state.base.items() for i, v in enumerate(vals)}
        session_tensors |= {f"residual.{p}.{i}": r for p, res in state.residual.items() for i, r in enumerate(res)}
        session_tensors["rng"] = torch.get_rng_state()
        self._failed = False
        self._pieces = self._copies()
        self._submit(("begin", (meta, session_tensors)), 0)

    def _copies(self) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        """The model's synced tensors, then the optimizer's state, about ``chunk_bytes`` at a
        time, each copied when the boundary asks for it."""
        piece: dict[str, torch.Tensor] = {}
        size = 0
        for name, t in self.params.items():
            n = t.numel() * t.element_size()
            if piece and size + n > self.chunk_bytes:
                yield "model", piece
                piece, size = {}, 0
            piece[name] = t.detach().to("cpu", copy=True)
            size += n
        if piece:
            yield "model", piece
        if self.optimizer is None:
            return
        server = StateServer(self.optimizer, self.learner, self.learner)
        while (ps := server.piece(self.chunk_bytes)) is not None:
            if ps.tensors:
                yield "optimizer", dict(ps.tensors)

    def _submit(self, job: tuple[str, Any], nbytes: int) -> None:
        with self._pending_lock:
            self._pending += nbytes
        self._jobs.put((job[0], (job[1], nbytes)))

    def _write_all(self) -> None:
        """The writer thread: one job at a time, until ``close``."""
        meta: dict[str, Any] = {}
        saving = self.folder / "saving"
        while (job := self._jobs.get()) is not None:
            kind, (what, nbytes) = job
            try:
                if self._failed:
                    pass  # this save is abandoned: skip its pieces until the next one begins
                elif kind == "begin":
                    meta, tensors = what
                    shutil.rmtree(saving, ignore_errors=True)
                    saving.mkdir(parents=True)
                    _save_file(tensors, saving / "session.safetensors")
                elif kind == "piece":
                    piece_kind, tensors = what
                    name = f"{piece_kind}-{len(meta[piece_kind]):05d}.safetensors"
                    _save_file(tensors, saving / name)
                    meta[piece_kind].append(name)
                else:
                    self._finish(saving, meta)
            except (OSError, RuntimeError, ValueError) as e:
                self._failed = True
                log.warning("learner %d: saving its state in %s failed (%s); it trains on, next try in %.0f s",
                            self.learner, self.folder, e, self.interval_s)  # fmt: skip
            finally:
                job = what = None  # the piece's copies go now, not with the next job
                with self._pending_lock:
                    self._pending -= nbytes
                if kind == "finish":
                    self._ended_at = time.monotonic()
                    self._writing.clear()

    def _finish(self, saving: Path, meta: dict[str, Any]) -> None:
        """The save is complete: its meta last, then it replaces the previous one."""
        (saving / "meta.json").write_text(json.dumps(meta))
        fsync_dir(saving)
        current, previous = self.folder / "current", self.folder / "previous"
        shutil.rmtree(previous, ignore_errors=True)
        if current.exists():
            current.rename(previous)
        saving.rename(current)
        fsync_dir(self.folder)
        shutil.rmtree(previous, ignore_errors=True)
        self.saves += 1
        self.last_save = {"began": float(meta["saved_at"]), "done": time.time()}

    def stats(self) -> dict[str, Any]:
        """What the saves cost so far (the learner's status ``local_state``)."""
        return {
            "saves": self.saves, "copy_s": round(self.copy_s, 4), "longest_copy_s": round(self.longest_copy_s, 4),
            "boundaries": self.boundaries, **({"last": self.last_save} if self.last_save else {}),
        }  # fmt: skip

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the writer (a save under way is left unfinished: the last complete one stays)."""
        self._jobs.put(None)
        self._thread.join(timeout_s)


def _ints(value: Any, n: int | None = None) -> list[int] | None:
    """``value`` as a list of whole numbers in [0, 2^53] (of length ``n``), or None."""
    if not isinstance(value, list) or (n is not None and len(value) != n):
        return None
    if any(type(v) is not int or not 0 <= v <= MAX_COUNT for v in value):
        return None
    return list(value)


def _read_meta(path: Path) -> dict[str, Any] | str:
    if not path.is_file():
        return "no complete save"
    if path.stat().st_size > META_MAX_BYTES:
        return f"{path} is over {META_MAX_BYTES >> 20} MiB"
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:
        return f"{path} is unreadable ({type(e).__name__})"
    return meta if isinstance(meta, dict) else f"{path} is not a JSON object"


def _files(meta: dict[str, Any], key: str, folder: Path) -> list[Path] | None:
    names = meta.get(key)
    if not isinstance(names, list) or len(names) > MAX_FILES:
        return None
    if any(not isinstance(n, str) or "/" in n or "\\" in n or not n.endswith(".safetensors") for n in names):
        return None  # only files of this folder
    return [folder / n for n in names]


def _fragment_tensors(session: Mapping[str, torch.Tensor], n: int) -> dict[str, dict[int, list[torch.Tensor]]] | str:
    """The session file's ``base.P.I`` and ``residual.P.I`` entries as a list per fragment (each
    index 0..k-1 once), or what is wrong with them."""
    found: dict[str, dict[int, dict[int, torch.Tensor]]] = {"base": {}, "residual": {}}
    for key, t in session.items():
        kind, _, rest = key.partition(".")
        p, _, i = rest.partition(".")
        if kind in found and p.isdigit() and i.isdigit() and int(p) < n:
            found[kind].setdefault(int(p), {})[int(i)] = t
        elif key != "rng":
            return f"its session file holds an unknown entry {key[:80]!r}"
    out: dict[str, dict[int, list[torch.Tensor]]] = {"base": {}, "residual": {}}
    for kind, table in found.items():
        for p, pieces in table.items():
            if sorted(pieces) != list(range(len(pieces))):
                return f"its {kind} copy of fragment {p} lacks pieces"
            out[kind][p] = [pieces[i] for i in range(len(pieces))]
    return out


def read_local_state(folder: Path, learner: int, layout: str, max_age_s: float) -> Saved | str:
    """The last complete save in ``folder``, or why there is none to take back: none there, of
    another format, learner or layout, older than ``max_age_s``, or damaged."""
    where = folder / "current" if (folder / "current").is_dir() else folder / "previous"
    meta = _read_meta(where / "meta.json")
    if isinstance(meta, str):
        return meta
    if meta.get("format") != FORMAT:
        return f"it is of format {meta.get('format')!r}, this ddiloco reads {FORMAT}: delete {folder} to join afresh"
    if meta.get("learner") != learner:
        return f"it is learner {meta.get('learner')!r}'s, not learner {learner}'s"
    if meta.get("layout") != layout:
        return "it was saved with another fragment layout (another model or algo.num_fragments)"
    saved_at = meta.get("saved_at")
    if not isinstance(saved_at, (int, float)) or not math.isfinite(saved_at):
        return "its save time is missing"
    age = time.time() - float(saved_at)
    if age > max_age_s:
        return f"it is {age:.0f} s old, more than runtime.local_state_max_age_s = {max_age_s:g} s"
    versions = _ints(meta.get("versions"))
    n = len(versions) if versions is not None else 0
    steps, tokens = _ints(meta.get("steps"), n), _ints(meta.get("tokens"), n)
    scalars = _ints([meta.get("step"), meta.get("fleet"), meta.get("data_position")])
    runs = meta.get("runs")
    merged = meta.get("merged_tokens")
    model_files, optim_files = _files(meta, "model", where), _files(meta, "optimizer", where)
    if versions is None or steps is None or tokens is None or scalars is None or model_files is None:
        return "its counters are damaged"
    if optim_files is None or not isinstance(merged, (int, float)) or not math.isfinite(merged):
        return "its counters are damaged"
    if not isinstance(runs, list) or any(not isinstance(r, str) or len(r) > RUN_ID_LEN for r in runs):
        return "its run identities are damaged"
    try:  # the headers now; the model's and optimizer's bytes as take_back takes them
        files = SavedTensors([where / "session.safetensors"])
        session = {k: files.pop(k) for k in list(files)}  # (one tensor's file mapping at a time)
        model, optimizer = SavedTensors(model_files), SavedTensors(optim_files)
    except Exception as e:  # safetensors raises its own error type on a damaged file
        return f"a file of it is unreadable ({type(e).__name__}: {str(e)[:200]})"
    tables = _fragment_tensors(session, n)
    if isinstance(tables, str):
        return tables
    state = LocalState(
        tuple(versions), tuple(steps), tuple(tokens), scalars[0], float(merged), scalars[1], tuple(runs),
        tables["base"], tables["residual"],
    )  # fmt: skip
    return Saved(state, model, optimizer, session.get("rng"), scalars[2], age)


def _model_problem(saved: Tensors, params: Mapping[str, torch.Tensor]) -> str | None:
    """Why the saved model tensors cannot be written into ``params`` (None: every one is there,
    of its shape and dtype; from the headers: the values are checked as they are written)."""
    if set(saved) != set(params):
        missing = sorted(set(params) - set(saved)) or sorted(set(saved) - set(params))
        return f"its model tensors do not match this model's (first: {missing[0][:80]!r})"
    for name in saved:
        p = params[name]
        shape, dtype = spec_of(saved, name)
        if shape != tuple(p.shape) or dtype != p.dtype:
            return f"its {name} is {shape} {dtype}, the model's {tuple(p.shape)} {p.dtype}"
    return None


def _optimizer_state(
    pieces: Tensors, params: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer, me: int
) -> tuple[PeerState | None, str | None]:
    """The saved optimizer pieces put together (the hand-off's rules and bound) and checked as a
    peer's state would be; or why not. ``pieces`` is emptied as they are put together: each row
    range goes as soon as it is copied into its tensor, so the state is not held twice."""
    from ddiloco.protocol.handoff import Reassembly
    from ddiloco.training.peer_state import check_state

    whole = Reassembly(4 * sum(p.numel() for p in params.values()) + (1 << 20))
    problem = None
    for key in list(pieces):
        problem = whole.add({key: pieces.pop(key)})
        if problem is not None:
            break
    tensors, problem = whole.finish() if problem is None else ({}, problem)
    if problem is not None:
        return None, f"its optimizer state: {problem}"
    state = PeerState(me, me, [], tensors)
    problem = check_state(optimizer, state)[1]
    return (state, None) if problem is None else (None, f"its optimizer state: {problem}")


def take_back(
    saved: Saved,
    session: LearnerSession,
    params: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
) -> str | None:
    """Write a save back into the model, the optimizer, the session and the RNG, or say why not.

    Its fit (names, shapes and dtypes of the model's tensors, the session's counters and copies,
    the optimizer's moments) is checked before anything is written, so such a refusal changes
    nothing. The model's values are read and checked as they are written, one tensor at a time
    (holding them all first was most of a restart's peak): a non-finite or unreadable one stops
    it there, with the model partly written and the session not restored, so the learner joins
    afresh and every fragment of its model is overwritten by the syncer's. ``saved`` is used up
    (its pieces are let go as they are taken: a restart holds the saved state about once)."""
    from ddiloco.protocol.local_state import check, restore
    from ddiloco.training.peer_state import load_state

    problem = _model_problem(saved.model, params) or check(session, saved.state)
    state = None
    if problem is None and optimizer is not None and saved.optimizer:
        state, problem = _optimizer_state(saved.optimizer, params, optimizer, session.learner)
    if problem is not None:
        return problem
    with torch.no_grad():
        for name in list(saved.model):  # each saved tensor goes once it is written (a restart's peak)
            try:
                t = saved.model.pop(name)
            except Exception as e:  # safetensors raises its own error type on a damaged file
                return f"its {name[:80]} is unreadable ({type(e).__name__}); its model is left to the join"
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                return f"its {name[:80]} holds non-finite values; its model is left to the join"
            params[name].copy_(t)
            del t
    if optimizer is not None and state is not None:
        device = next(iter(params.values())).device
        problem = load_state(optimizer, state, device)
        if problem is not None:  # checked above: only torch's own load can still refuse it
            return f"its optimizer state did not load ({problem})"
    if saved.rng is not None and saved.rng.dtype == torch.uint8:
        try:
            torch.set_rng_state(saved.rng)
        except RuntimeError:
            pass  # another build's RNG: the run goes on with this process's own
    return restore(session, saved.state)


def open_local_state(
    folder: Path,
    session: LearnerSession,
    params: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
    rt: RuntimeConfig,
    chain_history: int = 0,
) -> LocalStateSaver | None:
    """At a learner's start, before it registers: take back the last save in ``folder`` when
    there is one that fits (one line either way), then save every ``rt.local_state_s`` from now
    on (None: saving is off). ``chain_history``: the changes the syncer keeps per fragment (0:
    none, an fp32 down-link); a save is due once a fragment moved that many less one."""
    learner, layout = session.learner, session.registration.layout
    saved = read_local_state(folder, learner, layout, rt.local_state_max_age_s)
    problem = take_back(saved, session, params, optimizer) if isinstance(saved, Saved) else saved
    if isinstance(saved, Saved) and problem is None:
        session.data_position = saved.data_position
        log.info(
            "learner %d: took back its state saved %.0f s ago in %s (step %d, versions %s): it catches up by what "
            "changed since", learner, saved.age_s, folder, saved.state.step, _span(saved.state.versions),
        )  # fmt: skip
    elif isinstance(saved, Saved) or (folder / "current").exists() or (folder / "previous").exists():
        log.info("learner %d: its saved state in %s is not taken back: %s; joining afresh", learner, folder, problem)
    del saved  # (what it read is in the model, the optimizer and the session now, or let go)
    release_free_memory()  # before the first steps allocate: the heap kept the read's freed pieces
    if rt.local_state_s <= 0:
        return None
    chunk, buffer = int(rt.local_state_chunk_mb * (1 << 20)), int(rt.local_state_buffer_mb * (1 << 20))
    behind = max(1, chain_history - 1) if chain_history > 0 else 0
    return LocalStateSaver(folder, learner, layout, params, optimizer, rt.local_state_s, chunk,
                           rt.local_state_copy_share, buffer, behind)  # fmt: skip


def _span(versions: tuple[int, ...]) -> str:
    """A few versions as a range ("3..7", or "5")."""
    lo, hi = min(versions, default=0), max(versions, default=0)
    return f"{lo}..{hi}" if lo != hi else str(lo)
