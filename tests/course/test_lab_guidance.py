"""Every lab and exercise says how long it takes and what it builds on, and its hints come in folded tiers
(a nudge, the method, the answer) after each TODO cell, so a learner who wants to think can."""
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "labs").glob("lab[0-9]*.ipynb")) + sorted((ROOT / "labs").glob("ex[0-9]*.ipynb"))
HEADER = re.compile(r"\*\*Time:\*\* about (\d+) minutes · \*\*Prerequisites:\*\* (.+)")
TIERS = ("Hint 1: a nudge", "Hint 2: the method", "Hint 3: the answer")


def test_there_are_labs_and_exercises():
    assert len([p for p in NOTEBOOKS if p.name.startswith("lab")]) >= 6
    assert len([p for p in NOTEBOOKS if p.name.startswith("ex")]) == 10


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_time_prerequisites_and_tiered_hints(path):
    nb = nbformat.read(path, as_version=4)
    header = HEADER.search(nb.cells[0].source)
    assert header, f"{path.name}: the first cell needs '**Time:** about N minutes · **Prerequisites:** ...'"
    assert 5 <= int(header.group(1)) <= 180
    # the prerequisites name chapters, none after the notebook's own (an exercise follows its chapter)
    chapters = [int(n) for n in re.findall(r"chapters? (\d\d)", header.group(2))]
    assert chapters, f"{path.name}: the prerequisites name no chapter"
    own = int(re.match(r"(?:lab|ex)(\d\d)", path.stem).group(1))
    assert max(chapters) <= own, f"{path.name} needs chapter {max(chapters)}, which comes after it"

    todo_cells = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "raises-exception" in c.metadata.get("tags", [])]
    assert todo_cells, f"{path.name} has no TODO cell"
    for i in todo_cells:
        hints = nb.cells[i + 1] if i + 1 < len(nb.cells) else None
        assert hints is not None and hints.cell_type == "markdown", f"{path.name} cell {i}: no hints cell after it"
        found = [hints.source.find(f"<summary>{tier}</summary>") for tier in TIERS]
        assert -1 not in found and found == sorted(found), f"{path.name} cell {i + 1}: the three tiers, in order"
        assert hints.source.count("<details>") == 3 and hints.source.count("</details>") == 3
