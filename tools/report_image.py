"""The README's report image, made from run folders by the code rather than kept by hand: renders
``ddiloco report`` for the given runs and takes a headless Chromium screenshot of the page's top.

    make run && make simulate
    python tools/report_image.py runs/decoupled-REAL runs/decoupled-SIM -o docs/img/report.png

Needs Chromium (Debian: ``apt-get install chromium``); the size is the README's (880 x 2040).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run folders, in the order the report shows them")
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "docs" / "img" / "report.png")
    ap.add_argument("--size", default="880,2040", help="WIDTH,HEIGHT of the screenshot in pixels")
    args = ap.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        raise SystemExit("no Chromium found: apt-get install chromium (or put chromium on PATH)")
    from ddiloco.report.html import render_report

    with tempfile.TemporaryDirectory() as tmp:
        page = render_report(args.runs, Path(tmp) / "report.html")
        shot = Path(tmp) / "report.png"
        subprocess.run(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--window-size={args.size}",
             f"--screenshot={shot}", page.as_uri()],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, args.out)
    print(f"{args.out}: the report of {', '.join(str(r) for r in args.runs)}")


if __name__ == "__main__":
    main()
