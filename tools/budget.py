"""The size and complexity budget of ``src/``: `make lint` runs it (stdlib only, under a second).

- No module in ``src/`` over ``MAX_LINES`` lines, unless it is listed in ``LONG_MODULES`` with the
  reason it cannot be split.
- No function over ruff's mccabe complexity ``MAX_COMPLEXITY``: ruff checks that (``C901`` in
  pyproject.toml); this checker makes sure the rule stays on for ``src/`` at that bound, and counts
  the functions that opt out with ``# noqa: C901 (reason)``.
- At most ``MAX_EXCEPTIONS`` exceptions in all (listed modules plus ``C901`` opt-outs), each with
  its reason beside it: an exception is a debt written down, not a way round the budget.

Exit status 1 with one line per problem; ``python tools/budget.py [ROOT]`` (default: this repo).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # the package's own dependency on 3.10
    import tomli as tomllib

MAX_LINES = 800
MAX_COMPLEXITY = 15
MAX_EXCEPTIONS = 5

LONG_MODULES: dict[str, str] = {}
"""Modules (paths relative to the root, e.g. ``src/ddiloco/x.py``) allowed past ``MAX_LINES``,
each with why. Empty: every module fits."""

# `# noqa: C901 (why)` / `# noqa: E501, C901 - why`: the codes, then the reason (anything that is not a code).
_NOQA = re.compile(r"#\s*noqa\s*:\s*(?P<codes>[A-Z]+[0-9]+(?:[\s,]+[A-Z]+[0-9]+)*)(?P<rest>.*)$")
_BARE_NOQA = re.compile(r"#\s*noqa\b(?!\s*:)")  # hides every rule on its line, C901 included
_FILE_NOQA = re.compile(r"#\s*ruff\s*:\s*noqa\b")


@dataclass(frozen=True)
class Waiver:
    """One way past the budget."""

    where: str
    """``path:line`` of a ``# noqa: C901``, or the path of a listed long module."""
    reason: str
    """Why, as written beside it (empty: none given, which is itself a failure)."""


def _reason(rest: str) -> str:
    """The reason after a noqa's codes: its words without the brackets or dashes around them."""
    return rest.strip().strip("()-–—:;").strip()


def scan(root: Path, long_modules: Mapping[str, str]) -> tuple[list[str], list[Waiver]]:
    """(problems, exceptions) for the tree at ``root``: every module of ``src/`` past the line
    bound and not listed, every bare or file-wide noqa, and every exception found."""
    problems: list[str] = []
    exceptions = [Waiver(path, reason.strip()) for path, reason in sorted(long_modules.items())]
    for path in sorted((root / "src").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        lines = path.read_text(encoding="utf-8").splitlines()
        if len(lines) > MAX_LINES and rel not in long_modules:
            problems.append(f"{rel}: {len(lines)} lines, over the budget of {MAX_LINES}: split it by concept")
        for no, line in enumerate(lines, 1):
            if "noqa" not in line:
                continue
            where = f"{rel}:{no}"
            if _FILE_NOQA.search(line) or _BARE_NOQA.search(line):
                problems.append(f"{where}: a bare or file-wide noqa hides C901 too; name the codes it ignores")
            m = _NOQA.search(line)
            if m is not None and "C901" in re.split(r"[\s,]+", m["codes"]):
                exceptions.append(Waiver(where, _reason(m["rest"])))
    for rel in sorted(long_modules):
        if not (root / rel).is_file():
            problems.append(f"{rel}: listed in LONG_MODULES but not there; drop it from the list")
    return problems, exceptions


def check_ruff_config(root: Path) -> list[str]:
    """Problems with pyproject.toml's ruff settings: C901 must be selected, at ``MAX_COMPLEXITY``
    at most, and not ignored for anything in ``src/``."""
    path = root / "pyproject.toml"
    if not path.is_file():
        return [f"{path}: missing (the C901 settings live there)"]
    lint = tomllib.loads(path.read_text(encoding="utf-8")).get("tool", {}).get("ruff", {}).get("lint", {})
    problems = []
    selected = [*lint.get("select", []), *lint.get("extend-select", [])]
    if not any(code == "ALL" or "C901".startswith(code) for code in selected):
        problems.append("pyproject.toml: [tool.ruff.lint] select does not include C901")
    if "C901" in lint.get("ignore", []) or "C90" in lint.get("ignore", []):
        problems.append("pyproject.toml: [tool.ruff.lint] ignore turns C901 off")
    bound = lint.get("mccabe", {}).get("max-complexity")
    if not isinstance(bound, int) or bound > MAX_COMPLEXITY:
        problems.append(f"pyproject.toml: [tool.ruff.lint.mccabe] max-complexity = {bound}, want <= {MAX_COMPLEXITY}")
    for pattern, codes in lint.get("per-file-ignores", {}).items():
        if pattern.startswith(("src", "*", "**")) and any(c in ("C", "C9", "C90", "C901") for c in codes):
            problems.append(f"pyproject.toml: per-file-ignores {pattern!r} turns C901 off in src/")
    return problems


def check(root: Path, long_modules: Mapping[str, str] = LONG_MODULES) -> list[str]:
    """Every problem with the budget of the tree at ``root``; empty when it holds."""
    problems, exceptions = scan(root, long_modules)
    problems += check_ruff_config(root)
    for e in exceptions:
        if not e.reason:
            problems.append(f"{e.where}: an exception to the budget without a reason beside it")
    if len(exceptions) > MAX_EXCEPTIONS:
        listed = ", ".join(e.where for e in exceptions)
        problems.append(f"{len(exceptions)} exceptions to the budget, at most {MAX_EXCEPTIONS}: {listed}")
    return problems


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent
    problems = check(root)
    for line in problems:
        print(line, file=sys.stderr)  # a lint tool's report, like ruff's: no logging set-up to go through
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
