"""nanoserve.course.notebook.trim / show(hide=...): a chapter shows engine code trimmed to what it has taught."""
import pytest

from nanoserve.course.notebook import show, trim

SOURCE = '''def f(xs):
    total = 0
    for x in xs:
        if x < 0:          # later chapter
            raise ValueError(x)
        total += x
    log(total)
    audit(total)
    return total'''


def test_trim_hides_a_statement_and_its_block_behind_one_comment():
    out = trim(SOURCE, {"if x < 0": "chapter 9: reject negatives"})
    assert out.splitlines() == ["def f(xs):", "    total = 0", "    for x in xs:",
                                "        # ... chapter 9: reject negatives", "        total += x",
                                "    log(total)", "    audit(total)", "    return total"]


def test_trim_ranges_merge_adjacent_notes_and_silent_hides():
    out = trim(SOURCE, {"log(total)": "bookkeeping", "audit(total)": "bookkeeping", ("for x in", "total += x"): ""})
    assert out.splitlines() == ["def f(xs):", "    total = 0", "    # ... bookkeeping", "    return total"]


def test_trim_refuses_markers_that_do_not_name_one_line():
    with pytest.raises(ValueError, match="exactly one line.*matches 0"):
        trim(SOURCE, {"no such line": "x"})
    with pytest.raises(ValueError, match="matches 2"):
        trim(SOURCE, {"(total)": "x"})
    with pytest.raises(ValueError, match="overlap"):
        trim(SOURCE, {"for x in": "a", "total += x": "b"})


def test_show_trimmed_engine_source_says_so(capsys):
    from nanoserve.engine import Scheduler
    show(Scheduler.schedule_running, hide={"while not self.blocks.ensure": "chapter 04: preemption"})
    out = capsys.readouterr().out
    assert "(trimmed to this chapter)" in out and "# ... chapter 04: preemption" in out
    assert "self.preempt(" not in out and "def schedule_running(" in out
