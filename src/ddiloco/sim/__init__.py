"""Driver 1: deterministic virtual time. M learners and the syncer in one process, the
data-parallel reference, and ``simulate()``, the entry point the CLI and benchmarks share."""
