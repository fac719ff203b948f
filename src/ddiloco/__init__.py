"""ddiloco: Decoupled DiLoCo for resilient, low-communication distributed pre-training."""

__version__ = "0.1.0"
