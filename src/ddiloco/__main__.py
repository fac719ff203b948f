"""``python -m ddiloco ARGS`` = ``ddiloco ARGS``; also the form torchrun launches:
``torchrun --nproc-per-node N -m ddiloco learner --syncer tcp://HOST:PORT --id M``."""

import sys

from ddiloco.cli import main

if __name__ == "__main__":
    sys.exit(main())
