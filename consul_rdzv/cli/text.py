"""What every part of ``consul-rdzv`` shares: its errors (one line on stderr) and its text
helpers (durations, tables, times)."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from ..service import utc_iso

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$")


class CliError(Exception):
    """A failure the CLI reports as one line on stderr, exit code 1 (``app.main``)."""


class UsageError(CliError):
    """A bad argument value that argparse cannot see: exit code 2."""


def one_line(text: object) -> str:
    """``text`` with every run of whitespace (newlines included) as one space."""
    return " ".join(str(text).split())


def fmt_duration(seconds: float) -> str:
    """A short human duration: ``0.4s``, ``42s``, ``3m05s``, ``2h10m``, ``3d4h``."""
    seconds = max(0.0, seconds)
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 60:
        return f"{int(seconds)}s"
    minutes, sec = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{sec:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours}h"


def parse_duration(text: str) -> float:
    """``90``, ``30s``, ``10m``, ``2h``, ``1d`` as seconds (argparse type)."""
    m = _DURATION.match(text)
    if not m:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration: give seconds, or a number with s, m, h or d (e.g. 10m)")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2) or "s"]


def table(headers: list[str], rows: list[list[str]], indent: str = "") -> list[str]:
    """Left-aligned columns separated by two spaces (kubectl's look)."""
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=False)]
    lines = []
    for row in [headers, *rows]:
        cells = [str(cell).ljust(width) for cell, width in zip(row, widths, strict=False)]
        lines.append((indent + "  ".join(cells)).rstrip())
    return lines


def utc(ts: float | None) -> str | None:
    """An ISO time (UTC) for JSON output, as a heartbeat's (service.utc_iso)."""
    return utc_iso(ts) if ts else None


def print_json(doc: Any, *, compact: bool = False) -> None:
    """``doc`` on stdout: indented, or ``compact`` on one line (a ``watch --json`` frame)."""
    text = json.dumps(doc, separators=(",", ":")) if compact else json.dumps(doc, indent=2)
    print(text, flush=True)
