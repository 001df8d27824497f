"""Where a benchmark run's figures go: a JSON file, so every quoted number traces to one.

Each script in ``benchmarks/`` takes ``--json PATH``; with ``--check`` and no
``--json`` the figures go to ``runs/bench-<name>.json``. The file holds the
command line, the time, the commit (and whether the tree had changes), the
machine (host name, CPU count, Python), the figures the script printed and its
bars (name, value, bar, met)::

    ap.add_argument("--check", action="store_true", help="exit 1 if a bar is missed")
    _report.add_json_arg(ap)
    args = ap.parse_args()
    out = _report.json_path(ap, args, "stragglers")  # None: no file asked for
    ...
    _report.write(out, figures={"rows": rows}, bars=[_report.bar("ASP efficiency", 0.93, ">=", 0.9)])
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def add_json_arg(ap: argparse.ArgumentParser) -> None:
    """Adds ``--json PATH`` to a benchmark's parser."""
    ap.add_argument(
        "--json",
        metavar="PATH",
        help="write the figures to PATH (with --check, default runs/bench-<name>.json)",
    )


def json_path(ap: argparse.ArgumentParser, args: argparse.Namespace, name: str) -> Path | None:
    """The file to write (``--json``, or ``runs/bench-NAME.json`` under ``--check``), its folder
    made; None when neither is given. A path that cannot be written is a usage error
    (``ap.error``), before anything runs."""
    raw = getattr(args, "json", None)
    if raw is None and not getattr(args, "check", False):
        return None
    path = Path(raw) if raw is not None else Path("runs") / f"bench-{name}.json"
    if path.is_dir():
        ap.error(f"--json: {str(path)!r} is a folder, expected a file name")
    if path.parent.exists() and not path.parent.is_dir():
        ap.error(f"--json: {str(path.parent)!r} is not a folder")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        ap.error(f"--json: cannot make the folder {str(path.parent)!r}: {e.strerror or e}")
    if not os.access(path.parent, os.W_OK):
        ap.error(f"--json: cannot write into {str(path.parent)!r}")
    return path


def bar(name: str, value: float | None, op: str, limit: float) -> dict:
    """One bar: ``value op limit`` (``op`` is ``"<="`` or ``">="``) and whether it is met."""
    if op not in ("<=", ">="):
        raise ValueError(f"op must be '<=' or '>=', got {op!r}")
    ok = value is not None and math.isfinite(value)
    met = ok and (value <= limit if op == "<=" else value >= limit)
    return {"name": name, "value": value, "bar": f"{op} {limit:g}", "met": bool(met)}


def write(path: Path | None, figures: dict, *, bars: list[dict] | None = None) -> Path | None:
    """Writes the run's ``figures`` (any JSON-able structure; NumPy scalars, tuples and
    non-finite floats are converted, the last to null) and ``bars`` to ``path``, atomically;
    does nothing when ``path`` is None. Prints where it wrote."""
    if path is None:
        return None
    commit, dirty = _git()
    doc = {
        "benchmark": Path(sys.argv[0]).name,
        "argv": sys.argv[1:],
        "time_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit,
        "dirty": dirty,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "bars": _clean(bars or []),
        "figures": _clean(figures),
    }
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)
    print(f"\nfigures written to {path}")
    return path


def _git() -> tuple[str | None, bool | None]:
    """The checkout's commit and whether its tracked files have changes (None, None: no git)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None, None
    if head.returncode != 0:
        return None, None
    return head.stdout.strip(), bool(status.stdout.strip()) if status.returncode == 0 else None


def _clean(x: Any) -> Any:
    """``x`` as plain JSON values: NumPy scalars/arrays to Python, NaN/inf to None."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    if hasattr(x, "tolist") and callable(x.tolist):  # NumPy scalar or array
        return _clean(x.tolist())
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if x is None or isinstance(x, bool | int | str):
        return x
    return str(x)
