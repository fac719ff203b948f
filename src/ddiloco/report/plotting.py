"""matplotlib, an optional extra: the one place that imports it for every figure ddiloco draws."""

from __future__ import annotations

import logging
from typing import Any

from ddiloco.errors import DDiLoCoError


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the headless Agg backend, or one clear line on how to get it."""
    try:
        import matplotlib
    except ImportError:
        raise DDiLoCoError("drawing figures needs matplotlib: pip install 'ddiloco[plot]'") from None
    matplotlib.use("Agg")  # headless: never needs a display
    # its INFO lines ("generated new fontManager" on a first run) are not the run's news
    logging.getLogger("matplotlib").setLevel(max(logging.WARNING, logging.getLogger("matplotlib").level))
    import matplotlib.pyplot as plt

    return plt
