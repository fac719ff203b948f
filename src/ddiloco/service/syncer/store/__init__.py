"""Durable syncer state: per-fragment rotating logs, meta snapshots, durable marks, the event tape.

Layout of ``RUN_DIR/state/`` (``RUN_DIR/state/shard-{i}/`` when there are several syncer shards):

- ``frag-{p}.log``: one record per durable version of fragment p. Each record is the fragment's
  *full* state (values, outer momentum, counters) plus the syncer's meta state, so the newest
  valid record alone restores the fragment; older records are kept only until the log rotates.
- Bounded disk: an append that would take ``frag-{p}.log`` past ``log_bound`` times the record's
  size (``runtime.store_log_bound``, default 2), or the first append to it after a snapshot,
  *rotates* the log: the record is written to ``frag-{p}.next.log`` (fsynced, its directory entry
  fsynced), marked, and only then renamed over ``frag-{p}.log``, dropping every older record. No
  byte is copied (each version is written once), and the folder never holds more than
  ``log_bound`` records of each fragment plus one record in flight. A restore finishes a rotation
  whose record was marked (a crash before the rename) and drops one that was not (never
  acknowledged). So a fragment whose state is S bytes takes at most ``(log_bound + 1) * S`` (one
  fragment at a time), and the folder ``log_bound * state + the largest fragment + small files``.
- ``snapshot.bin``: the syncer's meta state, the layout signature, the owned list and each
  fragment's durable version (no tensors: the logs hold every fragment), written to a temp file
  and renamed into place; a snapshot also makes durable any record given to it that is newer
  than its log's, and rewrites the mark files to one mark per fragment. Folders written before
  the logs rotated may still hold tensors in ``snapshot.bin`` and a ``snapshot.prev.bin``: they
  are read as before, and the next snapshot replaces them.
- ``durable.log``: the high-water marks. After a record is fsynced, one fixed-size, CRC'd mark
  ``(fragment, version, end of that record in frag-{p}.log)`` is appended and fsynced; only then is
  the version acknowledged (a rotation's mark gives the end in ``frag-{p}.next.log``, which becomes
  ``frag-{p}.log`` with the rename that follows). A restore that cannot reach a marked version, or finds damaged bytes
  below a marked end (bytes that were fsynced), is a hard error: a deleted, zeroed, truncated or
  bit-flipped log can no longer roll a fragment back silently. Only an unmarked tail is cut.
- ``durable.mirror.log``: the same marks again, so that every durable version is written down in
  three files (its record, durable.log, the mirror): damage to any two of the state's files either
  leaves every durable version restorable or is a one-line StateError, never a silent rollback.
  The mirror's marks are written through at once (a killed process loses none) and fsynced with
  the tape (``tape_sync_s``, ``snapshot``, ``close``): only an OS crash inside that window, followed
  by damage to two more files, could go unnoticed. A restore that finds the two mark files
  different (a crash between them, one of them lost) writes both anew from what it restored;
  deleting *both* is how to accept the versions still readable after real damage.
- ``syncer.lock``: ``flock``ed from ``restore`` to ``close`` (holds the owner's pid), so a second
  syncer on the same folder is refused instead of mixing its history into ours.
- ``tape.jsonl``: the event tape, one JSON object a line; written through at once (a killed process
  loses nothing), fsynced at most every ``tape_sync_s`` and on ``flush_tape``/``snapshot``/``close``.
- ``FORMAT``: ``{"format": 4}`` (rotating logs and tensor-free snapshots are still format 4: a
  ddiloco from before reads such a folder, and refuses one with a ``frag-{p}.next.log`` left by a
  crash in one line); a folder of another format is refused, never guessed at. It is
  written (with empty mark files) when a fresh folder is first restored, so a state folder that
  was deleted can be told from one that never held anything.

A run folder whose syncer state is missing or empty but which holds a run (its run log, a
sibling shard's marks, a summary or a final model) is refused at restore: starting again at
version 0 would silently throw the run away and write the initial weights as its final model.
``start_over`` (``--start-over``, ``start_over=True``) is the explicit way to do that.

Records and snapshots share one framing: ``magic(4) | body length (u64) | crc32(body) (u32)``,
then the body ``json length (u32) | JSON header | raw little-endian tensor bytes``. No pickle. A
header is checked for its shape after its checksum (a CRC is no signature): a body whose header
is not the JSON object we write is corruption, said in one line.
A disk that fills up raises ``StoreFull`` and leaves no half record and no mark behind.

The package, one concept a module: ``frames`` (the bytes: framing, marks, header checks),
``folder`` (the folder, its counted writes, FORMAT and lock), ``marks`` (durable.log and its
mirror), ``logs`` (the fragment logs), ``syncer_store`` (``SyncerStore``: tape, snapshot, restore),
``run_state`` (a run whose state is gone; ``start_over``), ``errors``.

For benchmarks the store counts what it costs: ``disk_bytes()`` (the folder now, read from the
disk), ``peak_disk_bytes`` (the largest the folder was while this store wrote it),
``bytes_written`` / ``record_bytes_written`` / ``records_written`` and ``fsyncs``.
"""

from ddiloco.service.syncer.store.errors import StateError, StoreFull, StoreLocked
from ddiloco.service.syncer.store.frames import (
    FORMAT,
    LOCK,
    MARK_SIZE,
    MARKS,
    MIRROR,
    Tensors,
    _decode,
    _encode,
    _frame,
    _parse,
    _tensors,
)
from ddiloco.service.syncer.store.run_state import check_state, run_history, start_over
from ddiloco.service.syncer.store.syncer_store import Restored, SyncerStore

__all__ = [
    "FORMAT",
    "LOCK",
    "MARKS",
    "MARK_SIZE",
    "MIRROR",
    "Restored",
    "StateError",
    "StoreFull",
    "StoreLocked",
    "SyncerStore",
    "Tensors",
    "_decode",
    "_encode",
    "_frame",
    "_parse",
    "_tensors",
    "check_state",
    "run_history",
    "start_over",
]
