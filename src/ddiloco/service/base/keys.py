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

Keys by default: ``ddiloco train`` and ``ddiloco.SyncerServer`` make a run's keys in
``RUN_DIR/keys/`` (``run_keys``: the folder mode 0700, secrets 0600, existing pairs never
overwritten) unless told ``--insecure`` / ``insecure=True``, so that on loopback too a local
process can neither take a learner id nor pose as the syncer. A ``SyncerServer`` also notes its
address and keys folder in this process (``local_keys``): a ``Learner``, ``fetch_state`` or
``ddiloco status`` in the same process that is given no key finds them there.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import zmq
import zmq.auth

from ddiloco.errors import DDiLoCoError, UsageError

log = logging.getLogger(__name__)

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
        _known(d, name)
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


def _known(folder: Path, name: str) -> None:
    """A learner's key missing from a folder that holds other learners' keys: the id is not one
    of the run's (the likelier mistake than keys never made), said as such."""
    if not name.startswith("learner-") or (folder / f"{name}.key_secret").is_file():
        return
    try:
        ids = sorted(int(n) for f in folder.glob("learner-*.key_secret") if (n := f.name[8:-11]).isdigit())
    except OSError:
        return
    if ids:
        have = f"{ids[0]}..{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1)) else ", ".join(map(str, ids[:8]))
        raise DDiLoCoError(
            f"{name} has no key in {folder}, which holds the keys of learners {have}: give one of those ids "
            f"(run.num_learners), or make keys for more learners with `ddiloco keys {folder} --learners N`"
        )


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
    if not d.exists():  # only we can list it: a secret is never readable, not even before its chmod
        d.parent.mkdir(parents=True, exist_ok=True)
        d.mkdir(mode=0o700, exist_ok=True)
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


RUN_KEYS = "keys"
"""The folder of a run's own keys, inside its run folder."""


def run_keys(run_dir: str | Path, learners: int) -> Path:
    """The run's keys folder ``RUN_DIR/keys``, with pairs for the syncer, learners 0..learners-1
    and an observer (missing ones made, existing ones kept: a resumed run keeps its keys)."""
    d = Path(run_dir) / RUN_KEYS
    if d.is_symlink() or (d.exists() and not d.is_dir()):
        raise DDiLoCoError(f"{d} is not a folder of keys; move it away (ddiloco makes the run's keys there)")
    make_keys(d, learners)
    if d.stat().st_mode & 0o077:  # an older or hand-made folder: say so, keep going (the secrets are 0600)
        import logging

        logging.getLogger(__name__).warning("%s is readable by other users; chmod 700 it", d)
    return d


_local: dict[str, Path] = {}
_local_lock = threading.Lock()


def remember_local_keys(address: str, folder: Path) -> None:
    """Note that the syncer serving ``address`` in this process uses the keys in ``folder``."""
    with _local_lock:
        _local[address] = folder


def forget_local_keys(address: str) -> None:
    with _local_lock:
        _local.pop(address, None)


def local_keys(addresses: list[str]) -> Path | None:
    """The keys folder of a syncer serving one of ``addresses`` in this process, if any."""
    with _local_lock:
        return next((_local[a] for a in addresses if a in _local), None)


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


def client_keys(
    syncers: list[str], key: str | Path | ClientKeys | None, name: str, insecure: bool
) -> ClientKeys | None:
    """The keys to talk to ``syncers`` as ``name``: ``key`` is a folder from ``ddiloco keys`` (or
    the ``NAME.key_secret`` file in it, next to ``syncer.key``). Without one: the keys of a
    ``SyncerServer`` serving one of ``syncers`` in this process (it makes them by default); else
    none on this machine, or with ``insecure`` (which is said once)."""
    if isinstance(key, ClientKeys):
        return key
    if key is None and not insecure:
        key = local_keys(syncers)
    if key is not None:
        path = Path(key)
        if path.is_file():
            if path.name != f"{name}.key_secret":
                raise UsageError(f"key file {path} is not {name}.key_secret; pass that file or the folder holding it")
            path = path.parent
        if not (path / f"{name}.key_secret").exists() and (path / RUN_KEYS / f"{name}.key_secret").is_file():
            path = path / RUN_KEYS  # a run folder given for its keys (ddiloco train, SyncerServer make them there)
        return ClientKeys.load(path, name)
    remote = [a for a in syncers if not is_local(a)]
    if remote and not insecure:
        raise DDiLoCoError(
            f"{remote[0]} is not on this machine: pass the keys folder (--keys DIR, or key=DIR in Python) with "
            f"syncer.key and {name}.key_secret from `ddiloco keys`, or --insecure (insecure=True) on a trusted network"
        )
    if remote:
        log.warning("INSECURE: talking to %s without authentication or encryption", remote[0])
    return None


def handshake_problem(learner: int, address: str, why: str, keyed: bool) -> str:
    """The line a learner raises when the syncer at ``address`` refused its connection at the
    CURVE handshake (``why``: ``transport.HandshakeFailure``; ``keyed``: the learner has keys):
    a key problem, not a network one, and what to pass instead."""
    fix = "pass the run's keys folder: key=RUN_DIR/keys (--keys RUN_DIR/keys)"
    if why == "mechanism" and not keyed:
        return (
            f"learner {learner}: the syncer at {address} requires CURVE keys and this learner has none: pass "
            "key=RUN_DIR/keys (--keys RUN_DIR/keys)"
        )
    if why == "mechanism":
        return (
            f"learner {learner}: the syncer at {address} runs without keys (insecure) and this learner has keys: "
            "pass insecure=True and no key (--insecure, no --keys), or start the syncer with its keys"
        )
    if why == "auth":
        return (
            f"learner {learner}: the syncer at {address} does not admit this learner's key (learner-{learner}.key "
            f"is not one of the run's keys): {fix}"
        )
    return (
        f"learner {learner}: the CURVE handshake with the syncer at {address} failed: the syncer.key this learner "
        f"was given is not that syncer's public key: {fix}"
    )
