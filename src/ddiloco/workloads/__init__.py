"""Workloads: a byte-level GPT on Shakespeare, a synthetic task, and the plug-in contract."""
