"""Results of a run: goodput accounting, the run result, the run folder and its plots."""
