"""Argument types for the command line: each checks one argument at parse time and refuses a
bad one with a single line (argparse prints it after ``error: argument --X:`` and exits 2)."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

_TCP = re.compile(r"^tcp://(?:(?P<src>[^;]+);)?(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+|\*):(?P<port>[^:\]]+)$")
_SET = re.compile(r"^\s*[A-Za-z_]\w*\.[A-Za-z_]\w*\s*=")
_EXAMPLE = "tcp://HOST:PORT (e.g. tcp://127.0.0.1:5555) or ipc://PATH"


def _address(text: str, bind: bool) -> str:
    if text.startswith("ipc://"):
        if len(text) == len("ipc://"):
            raise argparse.ArgumentTypeError(f"{text!r} names no path; use ipc:///path/to/socket")
        return text
    if "://" not in text:
        hint = f"use tcp://{text}" if re.fullmatch(r"[^:/\s]+:\d+", text) else f"use {_EXAMPLE}"
        raise argparse.ArgumentTypeError(f"{text!r} is not a ZeroMQ address; {hint}")
    m = _TCP.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a ZeroMQ address; use {_EXAMPLE}")
    host, port = m["host"], m["port"]
    if host == "*" and not bind:
        raise argparse.ArgumentTypeError(f"{text!r}: '*' binds every interface; connect to a host name or address")
    if port == "*" and bind:
        return text  # any free port (the syncer reports the one it got)
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: port {port!r} is out of range; allowed: 1 .. 65535")
    return text


def connect_address(text: str) -> str:
    """A ZeroMQ address to connect to: ``tcp://HOST:PORT`` (optionally with a source,
    ``tcp://SRC:0;HOST:PORT``) or ``ipc://PATH``."""
    return _address(text, bind=False)


def bind_address(text: str) -> str:
    """A ZeroMQ address to bind: ``tcp://HOST:PORT``, where HOST may be ``*`` (every
    interface) and PORT ``*`` (any free port), or ``ipc://PATH``."""
    return _address(text, bind=True)


def int_range(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An integer ``lo <= n`` (``<= hi`` when given)."""
    allowed = f"{lo} .. {hi}" if hi is not None else f">= {lo}"

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer; allowed: {allowed}") from None
        if n < lo or (hi is not None and n > hi):
            raise argparse.ArgumentTypeError(f"{n} is out of range; allowed: {allowed}")
        return n

    parse.__name__ = "integer"  # argparse names the type in some messages
    return parse


def override(text: str) -> str:
    """A ``--set`` override: ``SECTION.KEY=VALUE`` (the value is TOML, or a bare word)."""
    if not _SET.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} must look like SECTION.KEY=VALUE (e.g. algo.quorum=2)")
    return text


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0."""
    try:
        s = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(s) or s <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range; allowed: seconds > 0")
    return s
