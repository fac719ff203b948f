"""Driver 2: the real distributed runtime. Wire format, protocol, syncer service, durable store,
learner loop and its comm thread, evaluator, local launcher and status files."""
