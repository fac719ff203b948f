"""What every process of the runtime stands on: wire format, transport, keys, clocks, status
files, start-up phases and one-shot observer requests. Imports no other wing of ``service``."""
