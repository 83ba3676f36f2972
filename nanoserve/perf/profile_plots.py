"""Pictures of a `Profile`: the timeline, the category breakdown, and the top operators on the roofline."""
from __future__ import annotations

COLORS = {"compute": "tab:green", "comm": "tab:purple", "memcpy": "tab:orange", "host": "tab:gray",
          "idle": "lightgray", "data": "tab:red", "tokenize": "tab:pink", "h2d": "tab:brown"}
_OTHER = ["tab:blue", "tab:olive", "tab:cyan", "gold", "navy"]


def color_of(category: str, _seen: dict = {}) -> str:
    if category in COLORS:
        return COLORS[category]
    return _seen.setdefault(category, _OTHER[len(_seen) % len(_OTHER)])


def plot_timeline(prof, ax=None):
    """One row per lane: what the wall time went to (the breakdown, instant by instant), then every host
    thread's labelled regions and every device lane's work. Time in ms from the start of the call."""
    import matplotlib.pyplot as plt

    t0 = prof.window[0]
    rows: list[tuple[str, dict[str, list[tuple[float, float]]]]] = [("wall time went to", prof._segments)]
    lanes: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for e in prof.events:
        if e.kind == "region":
            lanes.setdefault(f"regions, {e.lane}", {}).setdefault(e.category, []).append((e.start_s, e.end_s))
        elif e.kind == "device":
            lanes.setdefault(f"device, {e.lane}", {}).setdefault(e.category, []).append((e.start_s, e.end_s))
        elif e.lane == prof.compute_lane:
            label = "ops, compute thread" if prof.device == "cpu" else f"host ops, {e.lane}"
            lanes.setdefault(label, {}).setdefault(e.category, []).append((e.start_s, e.end_s))
    rows += sorted(lanes.items())
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.6 * len(rows) + 1.2))
    shown = set()
    for y, (_, cats) in enumerate(reversed(rows)):
        for cat, spans in cats.items():
            from nanoserve.perf.profile import _union
            bars = [((a - t0) * 1e3, (b - a) * 1e3) for a, b in _union(spans)]
            ax.broken_barh(bars, (y - 0.4, 0.8), color=color_of(cat), label=None if cat in shown else cat)
            shown.add(cat)
    ax.set_yticks(range(len(rows)), [name for name, _ in reversed(rows)])
    ax.set_xlim(0, prof.wall_s * 1e3)
    ax.set_xlabel("time since the call started (ms)")
    ax.set_title(f"Timeline: accelerator busy {prof.busy_fraction:.0%} of {prof.wall_s * 1e3:.0f} ms")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return ax


def plot_breakdown(prof, ax=None):
    """Horizontal bars: seconds per category of the breakdown."""
    import matplotlib.pyplot as plt

    parts = [(c, s) for c, s in prof.breakdown().items() if s > 0]
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.4 * len(parts) + 1.2))
    names = [c for c, _ in parts][::-1]
    secs = [s for _, s in parts][::-1]
    ax.barh(names, secs, color=[color_of(c) for c in names])
    for y, s in enumerate(secs):
        ax.text(s, y, f" {s / prof.wall_s:.0%}", va="center", fontsize=8)
    ax.set_xlabel("seconds of wall time")
    ax.set_title(f"Where {prof.wall_s:.2f} s went")
    return ax


def plot_top_ops_roofline(prof, n: int = 8, hardware=None, dtype: str | None = None, ax=None):
    """The top operators that have a FLOP count, on the roofline of `hardware` (default: measured here)."""
    from nanoserve.perf.hardware import measure_ceilings
    from nanoserve.perf.roofline import plot_roofline

    stats = [s for s in prof.top_ops(n=n, hardware=hardware, dtype=dtype) if s.intensity is not None]
    hw = hardware or measure_ceilings(device="cpu" if prof.device == "cpu" else None)
    dtype = dtype or ("fp32" if prof.device == "cpu" or hw.bf16_flops is None else "bf16")
    if not stats:
        raise ValueError("no operator in this profile has a FLOP count (torch.utils.flop_counter knows "
                         "matmuls, convolutions and attention): nothing to place on a roofline")
    return plot_roofline(hw, [(s.name, s.flops, s.bytes, s.seconds) for s in stats], ax=ax, dtype=dtype)
