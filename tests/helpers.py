"""Helpers shared by the tests that run a syncer and learners (imported as ``helpers``: pytest
puts this folder on the path of the test modules)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.fragments import TensorSpec, balanced_layout
from ddiloco.core.tape import RoundRecord
from ddiloco.protocol.config import RuntimeConfig
from ddiloco.protocol.learner_session import Registration
from ddiloco.report.tape import read_rounds

# A two-fragment toy model for the protocol sessions' tests (fuzz, insider).
SESSION_SPECS = [TensorSpec("w", (3, 2)), TensorSpec("b", (2,))]
SESSION_LAYOUT = balanced_layout(SESSION_SPECS, 2)
SESSION_PARAMS = [[s.name, list(s.shape)] for s in SESSION_SPECS]
SESSION_REGISTRATION = Registration(SESSION_PARAMS, SESSION_LAYOUT.digest())
SESSION_CFG = DiLoCoConfig(num_fragments=2, sync_every=4, overlap=1, liveness_timeout_s=2.0, takeover_after_s=1.0)
SESSION_RT = RuntimeConfig(heartbeat_interval_s=0.5, syncer_liveness_s=2.0, backoff_initial_s=0.1, backoff_max_s=1.0)

# A real runtime's timings shrunk for tests in one process (threads): liveness in a second,
# status twice a second, short backoff. Each test adds its own budgets and join timeout.
FAST_RUNTIME = [
    "algo.liveness_timeout_s=1.0",
    "runtime.heartbeat_interval_s=0.1",
    "runtime.syncer_liveness_s=1.0",
    "runtime.status_interval_s=0.5",
    "runtime.snapshot_interval_s=1.0",
    "runtime.backoff_max_s=0.3",
]


def wait_for(pred: Callable[[], Any], timeout: float = 30.0, what: str = "condition", poll: float = 0.05) -> Any:
    """Poll ``pred`` until it returns something true (returned), or fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")


def merges(run_dir: Path) -> list[RoundRecord]:
    """The rounds on a syncer's tape that merged something (an entry took part: ``was_merged``)."""
    return [r for r in read_rounds(Path(run_dir) / "state" / "tape.jsonl") if r.took_part]


@contextlib.contextmanager
def keyed_syncer(run_dir: Path, keys: Path, settings: list[str], host: str, learners: int = 2) -> Iterator[Any]:
    """A syncer with CURVE keys (made in ``keys`` for ``learners`` learners) on ``host``,
    serving in a thread until the block ends: yields (cfg, address, service)."""
    from ddiloco.config import load_config
    from ddiloco.service.base.keys import ServerKeys, make_keys
    from ddiloco.service.base.transport import ZmqSyncerSocket
    from ddiloco.service.ops.launcher import free_port
    from ddiloco.service.syncer.service import SyncerService

    make_keys(keys, learners=learners)
    cfg = load_config(None, settings)
    addr = f"tcp://{host}:{free_port(host)}"
    service = SyncerService(cfg, ZmqSyncerSocket(addr, keys=ServerKeys.load(keys)), run_dir,
                            fsync=False, keys=ServerKeys.load(keys))  # fmt: skip
    t = threading.Thread(target=service.serve, daemon=True)
    t.start()
    try:
        yield cfg, addr, service
    finally:
        service.stop()
        t.join(timeout=30)
