"""Workloads: a byte-level GPT on any text (Shakespeare by default), a synthetic task, the plug-in contract."""
