"""Operations on a run: the local launcher (``ddiloco train``), the evaluator process,
``ddiloco status``, ``ddiloco alive`` and the learners' books. May import every other wing."""
