"""Formatting shared by the results page and the README's headline lines: numbers, tables, run headers, cards."""
from __future__ import annotations

import math
import pathlib
import re


def fmt(x) -> str:
    """3 significant digits for floats, ints as they are, bools as yes / no, missing as '-'."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if math.isnan(x) or math.isinf(x):
            return str(x)
        return f"{x:.3g}"
    if isinstance(x, (list, tuple)):
        return " x ".join(fmt(v) for v in x)
    return str(x).replace("|", "\\|").replace("\n", " ")


def get(d, *path, default=None):
    """d[path[0]][path[1]]...; ``default`` where any step is missing."""
    for k in path:
        if isinstance(d, dict) and k in d:
            d = d[k]
        elif isinstance(d, list) and isinstance(k, int) and -len(d) <= k < len(d):
            d = d[k]
        else:
            return default
    return d


def table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
    return out


def machine_of(d) -> str:
    m = d.get("machine")
    if isinstance(m, str):
        cores = f", {d['cpus']} cores" if d.get("cpus") else ""
        return m + cores + (f", torch {d['torch']}" if d.get("torch") else "")
    if not isinstance(m, dict):
        m = {}
    v = d.get("versions") if isinstance(d.get("versions"), dict) else {}
    parts = [m.get("gpu") or d.get("device") or m.get("cpu") or m.get("processor") or m.get("platform")]
    cores = m.get("cores") or m.get("cpu_count") or d.get("cpus")
    if cores and not m.get("gpu"):
        parts.append(f"{cores} cores")
    torch = m.get("torch") or v.get("torch") or d.get("torch")
    if torch:
        parts.append(f"torch {torch}")
    triton = m.get("triton") or v.get("triton")
    if triton:
        parts.append(f"triton {triton}")
    return ", ".join(str(p) for p in parts if p) or "-"


def date_of(d) -> str:
    for k in ("started_utc", "date_utc", "time_utc", "finished_utc"):
        if d.get(k):
            return str(d[k])
    return "-"


def header(d, command=None) -> list[str]:
    cmd = command or d.get("command") or "-"
    return [f"- command: `{cmd}`", f"- machine: {machine_of(d)}", f"- date: {date_of(d)}", ""]


def card_of(stem: str) -> str | None:
    """The GPU a result file's stem names ('_h200' or '_h100'), None for a CPU result."""
    return "H100" if "_h100" in stem else "H200" if "h200" in stem else None


def count(n) -> str:
    return f"{int(n):,}"


def ratio(x) -> str:
    return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def span(xs) -> str:
    lo, hi = ratio(min(xs)), ratio(max(xs))
    return f"{lo}x" if lo == hi else f"{lo}-{hi}x"


def small(x) -> str:
    """1.9073e-06 -> '1.9e-6'."""
    m, _, e = f"{x:.2g}".partition("e")
    return f"{m}e{int(e)}" if e else m


def diff_words(tokens, mismatches, control=None, stock="stock HF", max_abs=None) -> str:
    """'Diff = 0 on N of N tokens' or 'M of N tokens differ (max D)', with the stock control's count."""
    notes = [f"max {small(max_abs)}"] if mismatches and max_abs else []
    notes += [f"{stock}: {count(control)} differ"] if control is not None else []
    if not tokens:  # nothing compared is no evidence of equality
        return "no tokens compared"
    said = (f"Diff = 0 on {count(tokens)} of {count(tokens)} tokens" if mismatches == 0
            else f"{count(mismatches)} of {count(tokens)} tokens differ")
    return said + (f" ({'; '.join(notes)})" if notes else "")


def card_in(d, name: str) -> str | None:
    """The card a result ran on: its machine record, else the file name's card."""
    m = d.get("machine")
    gpu = m.get("gpu") if isinstance(m, dict) else m
    found = re.search(r"H[12]00", str(gpu or d.get("device") or ""))
    return found.group(0) if found else card_of(pathlib.Path(name).stem)
