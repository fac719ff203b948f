"""Exponential moving average, seeded by its first sample."""

from __future__ import annotations


class Ema:
    """value <- decay*value + (1-decay)*sample; the first sample sets the value."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.value: float | None = None

    def update(self, sample: float) -> float:
        self.value = sample if self.value is None else self.decay * self.value + (1 - self.decay) * sample
        return self.value

    def get(self, default: float = 0.0) -> float:
        return default if self.value is None else self.value
