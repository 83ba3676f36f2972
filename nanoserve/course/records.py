"""Results recorded on other machines (a GPU run, the other kind of CPU), for a notebook to show as records.

A notebook measures what it asserts on the machine it runs on. What another machine measured is a *record*:
loaded from `benchmarks/results/`, shown with the machine, the date and the commit it ran, never asserted and
never called "here". `load` finds records, `Record.describe` is the line a table or a caption prints.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


@dataclass(frozen=True)
class Record:
    """One recorded run: its JSON (`data`), where it lies, and what ran it."""

    path: Path
    data: dict

    def __getitem__(self, key):
        return self.data[key]

    @property
    def run_dir(self) -> Path:
        return self.path.parent

    @property
    def _run_machine(self) -> dict:
        """machine.json of a `make gpu-check` run (GPU, driver, commit), when the record is part of one."""
        f = self.run_dir / "machine.json"
        return json.loads(f.read_text()) if f.is_file() and f != self.path else {}

    @property
    def machine(self) -> str:
        """The machine in words: the GPU if one ran it, else the CPU and its cores."""
        run = self._run_machine
        m = self.data.get("machine") if isinstance(self.data.get("machine"), dict) else {}
        if run.get("gpus"):
            return f"{run['gpus'][0]['name']} (torch {run.get('torch', '?')})"
        if m.get("cuda"):
            return f"{m['cuda']} (torch {m.get('torch', '?')})"
        cpu = m.get("cpu") or run.get("cpu") or "unrecorded machine"
        cores = m.get("cores")
        return f"{cpu}, {cores} cores" if cores else cpu

    @property
    def date(self) -> str:
        """The run's UTC date and time (YYYY-MM-DD HH:MM), from the record or its file name."""
        d = self.data.get("date") or self._run_machine.get("date")
        if d:
            return d[:16].replace("T", " ")
        stamp = self.path.stem.rsplit("-", 1)[-1]          # name-YYYYMMDDTHHMMSSZ
        if len(stamp) == 16 and stamp[8] == "T":
            return f"{stamp[:4]}-{stamp[4:6]}-{stamp[6:8]} {stamp[9:11]}:{stamp[11:13]}"
        return "undated"

    @property
    def commit(self) -> str | None:
        """The commit that ran, where the record or its run's machine.json names one."""
        m = self.data.get("machine") if isinstance(self.data.get("machine"), dict) else {}
        c = self.data.get("commit") or m.get("commit") or self._run_machine.get("commit")
        return c[:10] if c else None

    def describe(self) -> str:
        """'recorded on <machine>, <date> UTC, commit <c>' : the caption every shown record carries."""
        commit = f"commit {self.commit}" if self.commit else "commit not recorded"
        where = self.path.relative_to(RESULTS) if self.path.is_relative_to(RESULTS) else self.path.name
        return f"recorded on {self.machine}, {self.date} UTC, {commit} ({where})"


def load(pattern: str, root: Path | None = None) -> list[Record]:
    """Every record under `benchmarks/results/` whose path (relative to it) matches the glob `pattern`,
    oldest first, e.g. `load("gpu-*/decode_latency-*.json")`. Raises FileNotFoundError naming the pattern
    when none matches, so a notebook never silently shows nothing."""
    root = root or RESULTS
    paths = sorted(root.glob(pattern), key=lambda p: p.name.rsplit("-", 1)[-1])
    if not paths:
        raise FileNotFoundError(f"no recorded result matches {pattern!r} under {root}")
    return [Record(p, json.loads(p.read_text())) for p in paths]


def latest(pattern: str, root: Path | None = None) -> Record:
    """The newest record matching `pattern` (see `load`)."""
    return load(pattern, root)[-1]
