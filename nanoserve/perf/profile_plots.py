"""Pictures of a profile: the timeline, the category breakdown, and the top operators on the roofline.

Each function draws the numbers it is given (a `Profile` hands them over); nothing here reads a trace."""
from __future__ import annotations

COLORS = {"compute": "tab:green", "comm": "tab:purple", "memcpy": "tab:orange", "host": "tab:gray",
          "idle": "lightgray", "data": "tab:red", "tokenize": "tab:pink", "h2d": "tab:brown"}
_OTHER = ["tab:blue", "tab:olive", "tab:cyan", "gold", "navy"]


def color_of(category: str, _seen: dict = {}) -> str:
    if category in COLORS:
        return COLORS[category]
    return _seen.setdefault(category, _OTHER[len(_seen) % len(_OTHER)])


def plot_timeline(rows, window: tuple[float, float], busy_fraction: float, ax=None):
    """One bar row per (label, {category: [(start_s, end_s), ...]}) of `rows` (`Profile.timeline()`),
    the first row on top; time in ms from the start of `window` (start_s, end_s)."""
    import matplotlib.pyplot as plt

    t0, wall_s = window[0], window[1] - window[0]
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.6 * len(rows) + 1.2))
    shown = set()
    for y, (_, cats) in enumerate(reversed(rows)):
        for cat, spans in cats.items():
            bars = [((a - t0) * 1e3, (b - a) * 1e3) for a, b in spans]
            ax.broken_barh(bars, (y - 0.4, 0.8), color=color_of(cat), label=None if cat in shown else cat)
            shown.add(cat)
    ax.set_yticks(range(len(rows)), [name for name, _ in reversed(rows)])
    ax.set_xlim(0, wall_s * 1e3)
    ax.set_xlabel("time since the call started (ms)")
    ax.set_title(f"Timeline: accelerator busy {busy_fraction:.0%} of {wall_s * 1e3:.0f} ms")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return ax


def plot_breakdown(breakdown: dict[str, float], wall_s: float, ax=None):
    """Horizontal bars: seconds per category of `breakdown` (`Profile.breakdown()`), out of `wall_s`."""
    import matplotlib.pyplot as plt

    parts = [(c, s) for c, s in breakdown.items() if s > 0]
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.4 * len(parts) + 1.2))
    names = [c for c, _ in parts][::-1]
    secs = [s for _, s in parts][::-1]
    ax.barh(names, secs, color=[color_of(c) for c in names])
    for y, s in enumerate(secs):
        ax.text(s, y, f" {s / wall_s:.0%}", va="center", fontsize=8)
    ax.set_xlabel("seconds of wall time")
    ax.set_title(f"Where {wall_s:.2f} s went")
    return ax


def plot_top_ops_roofline(stats, hardware, dtype: str, ax=None):
    """Operators (`OpStat`s with a FLOP count) on the roofline of `hardware` at `dtype`."""
    from nanoserve.perf.roofline import plot_roofline

    return plot_roofline(hardware, [(s.name, s.flops, s.bytes, s.seconds) for s in stats], ax=ax, dtype=dtype)
