"""What both drivers share about training: the inner optimizer and its LR schedule, evaluation,
and the model's fragment layout."""
