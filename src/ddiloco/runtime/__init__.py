"""Drivers of the core: the virtual-time simulator (and, later, the real distributed runtime)."""
