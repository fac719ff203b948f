"""The benchmarks' shared harness: what every bench in bench/ needs and states once.

- ``paths``: the repository's folders, the one-thread environment of every process a bench starts,
  ``--set`` pairs; importing it puts this tree's ``src/`` first on ``sys.path`` (a bench runs as a
  script). ``files`` and ``sampling`` leave ``sys.path`` alone: a bench that runs other sources
  (bench/scale_fleet.py ``--src``) imports only those.
- ``files``: a run folder read back: JSON and JSON-lines files, the tape read as it grows, step logs.
- ``cluster``: a syncer, learners, an evaluator, the link relay and a bench's own helper roles as
  processes of ``python -m ddiloco ...``: start, kill, SIGSTOP/SIGCONT, restart, stop all, status.
- ``cells``: one configuration run = one cell, cached as JSON under ``bench/cache/NAME/``, keyed by a
  digest of its settings, written the moment the cell ends (an interrupted bench resumes).
- ``sampling``: CPU seconds, RSS and peaks of processes from /proc, sampled over time; quantiles,
  rates and the spread of repeated measurements.
- ``tables``: markdown tables and the ``docs/results/NAME.md`` + ``.json`` pair with the command,
  date, machine and config that produced them.

A bench imports what it uses from these modules (``from harness.cluster import Cluster``); the
package itself imports nothing heavy (no torch, no ddiloco), so a bench's ``--help`` stays instant.
"""
