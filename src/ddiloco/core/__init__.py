"""The Decoupled DiLoCo algorithm, pure: state machines given events and the time.

No sockets, threads, clocks, files or randomness of its own live here; runtimes drive it.
"""
