"""Operations on a run: the local launcher (``ddiloco train``), the evaluator process,
``ddiloco status`` and the learners' books. May import every other wing."""
