"""Keys for ZeroMQ CURVE: who may talk to a syncer, and as whom.

``ddiloco keys DIR --learners M`` writes one key pair per party with ZeroMQ's own certificate
files (``NAME.key`` public, ``NAME.key_secret`` secret):

- ``syncer``: the syncer's pair; learners and observers need its public half;
- ``learner-0`` ... ``learner-{M-1}``: one pair per learner id. The syncer admits learner id m
  only from the holder of ``learner-m``'s secret: an id is bound to its key;
- ``observer``: a read-only client (evaluator, ``status``): it may fetch the global model and
  nothing else.

A learner machine needs ``syncer.key`` and its own ``learner-m.key_secret``; the syncer needs
``syncer.key_secret`` and every public ``*.key``. Every message is then authenticated and
encrypted; an unknown key gets nothing (the handshake fails before any message is read).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import zmq
import zmq.auth

from ddiloco.errors import DDiLoCoError

Role = Literal["learner", "observer"]
_LEARNER = re.compile(r"^learner-(\d+)\.key$")


@dataclass(frozen=True)
class Peer:
    """What an allowed public key may do."""

    role: Role
    learner: int | None = None
    """The learner id the key is bound to (learners only)."""


@dataclass(frozen=True)
class ServerKeys:
    """The syncer's key pair and the public keys it admits."""

    public: bytes
    secret: bytes
    allowed: dict[bytes, Peer]
    """Z85 public key -> who it is."""

    @classmethod
    def load(cls, folder: str | Path) -> ServerKeys:
        d = Path(folder)
        public, secret = _pair(d / "syncer.key_secret")
        allowed: dict[bytes, Peer] = {}
        for path in sorted(d.glob("*.key")):
            if path.name == "syncer.key":
                continue
            key, _ = zmq.auth.load_certificate(path)
            m = _LEARNER.match(path.name)
            allowed[key] = Peer("learner", int(m.group(1))) if m else Peer("observer")
        if not allowed:
            raise DDiLoCoError(f"{d} holds no learner or observer public keys; make them with `ddiloco keys {d}`")
        return cls(public, secret, allowed)


@dataclass(frozen=True)
class ClientKeys:
    """A learner's or observer's key pair, and the syncer's public key."""

    public: bytes
    secret: bytes
    server: bytes

    @classmethod
    def load(cls, folder: str | Path, name: str) -> ClientKeys:
        d = Path(folder)
        public, secret = _pair(d / f"{name}.key_secret")
        server_file = d / "syncer.key"
        if not server_file.is_file():
            raise DDiLoCoError(f"{server_file} is missing: copy the syncer's public key there")
        server, _ = zmq.auth.load_certificate(server_file)
        return cls(public, secret, server)

    def apply(self, sock: zmq.Socket) -> None:  # type: ignore[type-arg]
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.server


def _pair(secret_file: Path) -> tuple[bytes, bytes]:
    if not secret_file.is_file():
        raise DDiLoCoError(f"{secret_file} is missing: make keys with `ddiloco keys {secret_file.parent}`")
    try:
        public, secret = zmq.auth.load_certificate(secret_file)
    except (ValueError, OSError) as e:
        raise DDiLoCoError(f"{secret_file} is not a ZeroMQ key file ({e}); make keys with `ddiloco keys`") from None
    if secret is None:
        raise DDiLoCoError(f"{secret_file} holds no secret key; use the .key_secret file")
    return public, secret


def make_keys(folder: str | Path, learners: int, observers: int = 1) -> list[Path]:
    """Write key pairs for the syncer, ``learners`` learners and ``observers`` observers;
    existing files are never overwritten."""
    if not zmq.has("curve"):
        raise DDiLoCoError("this ZeroMQ build has no CURVE support; install pyzmq from PyPI (it bundles one)")
    d = Path(folder)
    d.mkdir(parents=True, exist_ok=True)
    names = ["syncer", *(f"learner-{m}" for m in range(learners))]
    names += ["observer"] if observers == 1 else [f"observer-{i}" for i in range(observers)]
    made = []
    for name in names:
        if (d / f"{name}.key_secret").exists():
            continue
        zmq.auth.create_certificates(d, name)
        (d / f"{name}.key_secret").chmod(0o600)
        made.append(d / f"{name}.key_secret")
    return made


def is_local(address: str) -> bool:
    """Whether a ZeroMQ address stays on this machine (loopback, ipc, inproc)."""
    if address.startswith(("ipc://", "inproc://")):
        return True
    m = re.match(r"^tcp://(?:[^;]*;)?\[?([^\]]+?)\]?:(\d+|\*)$", address)
    if not m:
        return False
    host = m.group(1)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name or an interface: assume the network
