"""Shared by the lab grader tests: a lab as generated must fail, its solution must pass every check."""
from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import nbformat

from nanoserve.course import grade

ROOT = Path(__file__).resolve().parents[2]


def prints_check(text: str, name: str) -> bool:
    """Whether `text` (a cell's printed output) has the PASS or FAIL line of check `name`."""
    return re.search(rf"^(PASS|FAIL) {re.escape(name)}(?=[:\s])", text, re.M) is not None


def stub_problems(nb) -> tuple[int, list[str]]:
    """(TODO cells, problems) of an executed lab: the cells before the first TODO must have run cleanly,
    and every TODO cell must stop at its stub's NotImplementedError("TODO: ..."). Cells after the first
    TODO may fail (they use what the learner has not written yet) and are not judged."""
    todo_cells, problems = 0, []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        err = grade.cell_error(cell)
        what = "no error" if err is None else f"{err['ename']}: {err['evalue']}"
        if grade.is_todo_cell(cell):
            todo_cells += 1
            if err is None or err["ename"] != "NotImplementedError" or not err["evalue"].startswith("TODO"):
                problems.append(f"cell {index} (TODO) should raise NotImplementedError('TODO: ...'), got {what}")
        elif todo_cells == 0 and err is not None:
            problems.append(f"cell {index}, before the first TODO, failed: {what}")
    return todo_cells, problems


def assert_unsolved_fails(lab: Path, tmp_path: Path, capsys, must_not_pass: tuple[str, ...], todos: int = 3) -> str:
    """Grade a learner's untouched copy: non-zero exit, `todos` stubs, none of `must_not_pass`; and, from the
    same run, the stubs behave (`stub_problems`). The run is the replay of the lab's cells in this session's
    nbval run of its solution when there was one (`unsolved`), else the grader's own run of a copy."""
    executed = UNSOLVED_RUNS.get(lab.name)
    if executed is not None:
        report = grade.Report(lab, grade.collect_checks(executed))
        code, out = (0 if report.ok else 1), grade.format_report(report)
    else:
        copy = tmp_path / lab.name
        shutil.copy(lab, copy)
        saved = tmp_path / f"executed-{lab.name}"
        code = grade.main([str(copy), "--save", str(saved)])
        out, executed = capsys.readouterr().out, nbformat.read(str(saved), as_version=4)
    assert code == 1, out
    assert out.count("not implemented: NotImplementedError: TODO:") == todos, out
    assert not re.search(rf"PASS\s+({'|'.join(must_not_pass)})\s", out), out
    todo_cells, problems = stub_problems(executed)
    assert todo_cells == todos and not problems, "\n".join(problems)
    return out


def assert_solution_passes(solution: Path, checks: tuple[str, ...]) -> None:
    """The committed solution, as executed, passes every check and nothing else.

    Nothing is run here: nbval re-runs the solution and compares its outputs with these, PASS lines
    included (the sanitizer hides numbers, not verdicts), so a check that fails on a re-run fails nbval.
    Running the solution again through the grader would only repeat that run (a minute a lab on 2 cores).
    """
    from nanoserve.course.grading import parse_line
    nb = nbformat.read(str(solution), as_version=4)
    lines = [line for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
             if o.get("output_type") == "stream" for line in o.get("text", "").splitlines()]
    results = [r for r in map(parse_line, lines) if r is not None]
    assert sorted(r.name for r in results) == sorted(checks), [r.name for r in results]
    failed = [f"{r.name}: {r.detail}" for r in results if not r.passed]
    assert not failed, failed


def _edited_code(solution: Path, edits: list[tuple[str, str]]):
    """(the solution notebook, its code cells, their sources with each `old` text, found in exactly one code
    cell, replaced by `new`)."""
    nb = nbformat.read(str(solution), as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    edited = [c.source for c in code]
    for old, new in edits:
        hits = [i for i, source in enumerate(edited) if old in source]
        assert len(hits) == 1, f"expected one cell of {solution.name} to contain {old!r}, found {len(hits)}"
        edited[hits[0]] = edited[hits[0]].replace(old, new)
    return nb, code, edited


def _printing_cell(code, through: str, name: str) -> int:
    """The index, among `code` cells, of the one whose committed output prints check `through`."""
    printed = [i for i, c in enumerate(code)
               if any(prints_check(o.get("text", ""), through) for o in c.get("outputs", []))]
    assert len(printed) == 1, f"expected one cell of {name} to print check {through!r}, found {len(printed)}"
    return printed[0]


def grade_edited_solution(solution: Path, edits: list[tuple[str, str]], tmp_path: Path, capsys,
                          through: str | None = None) -> tuple[int, str]:
    """Grade a copy of the solution with each `old` text (found in exactly one cell) replaced by `new`:
    a learner who got one step wrong. Returns the grader's exit code and what it printed.

    `through`: run only up to the cell that prints that check (found in the committed solution's outputs).
    The later cells are the costly lever runs (half a lab's time); a test that asserts on the checks up to
    there does not need them, and nbval runs the whole solution anyway."""
    nb, code, edited = _edited_code(solution, edits)
    for cell, source in zip(code, edited):
        cell.source = source
    if through is not None:
        last = code[_printing_cell(code, through, solution.name)]
        nb.cells = nb.cells[:next(i for i, c in enumerate(nb.cells) if c is last) + 1]
    path = tmp_path / solution.name
    nbformat.write(nb, str(path))
    code = grade.main([str(path)])
    return code, capsys.readouterr().out


# --- a learner's mistake, replayed in nbval's run of the solution ----------------------------------------
# Grading an edited copy of the solution would execute the lab's setup and measurements again (half a minute
# to a minute a lab on 2 cores) only to feed a wrong answer to one check. nbval already executes the solution
# in this test run, so conftest.py replays each registered mistake in that kernel, right after the cell that
# prints the check it is about: of the cells from the first one edited to that cell, those the edits can
# change (`replay_plan`) run in the notebook's namespace, which is then put back as it was (what they rebind is
# dropped), and the grading results they add are removed again, so the solution's later cells see exactly what they would have.
# The mistake's checks are judged on the learner's own measurements of this very run. Run alone (no nbval pass
# of the solution in the session), a mistake test grades an edited copy.

MISTAKES: dict[str, dict[str, tuple[list[tuple[str, str]], str]]] = {}   # solution name -> {id: (edits, through)}
REPLAYS: dict[tuple[str, str], str] = {}   # (solution name, id) -> what the solution's cells and the replay printed


def mistake(solution: Path, mistake_id: str, edits: list[tuple[str, str]], through: str) -> str:
    """Register a learner's mistake in `solution` for conftest.py to replay after the cell printing `through`."""
    MISTAKES.setdefault(solution.name, {})[mistake_id] = (edits, through)
    return mistake_id


def _names(source: str) -> tuple[set[str], set[str]] | None:
    """(names a cell reads, names it binds or assigns into), or None when it is not plain Python (a magic).
    Reads include those inside its functions and lambdas; binds include `x[...] = ` and `x.attr = ` targets, not
    the names a function or a comprehension binds in its own scope (a `global` statement there is not seen)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    reads, binds = set(), set()
    local = set()   # names stored in a function's or a comprehension's own scope: the cell binds none of them
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            local.update(id(n) for stmt in ([node.body] if isinstance(node, ast.Lambda) else node.body)
                         for n in ast.walk(stmt) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load))
        elif isinstance(node, ast.comprehension):
            local.update(id(n) for n in ast.walk(node.target) if isinstance(n, ast.Name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load):
                reads.add(node.id)
            elif id(node) not in local:
                binds.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            binds.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            binds.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(node.ctx, ast.Store):
            base = node.value
            while isinstance(base, (ast.Subscript, ast.Attribute)):
                base = base.value
            if isinstance(base, ast.Name):
                binds.add(base.id)
    return reads, binds


def replay_plan(solution: Path, edits: list[tuple[str, str]], through: str) -> tuple[list[str], list[str]]:
    """(sources of the solution's cells whose printed checks the mistake keeps, sources to run for it).

    From the first edited cell through the cell that prints `through`, a cell runs again if it is edited or reads
    a name that a cell run again before it binds; any other cell would compute what it did in the solution's run
    (a measurement, seconds to a minute), so its results stay in the namespace and its printed checks are kept.
    The rule sees names, not objects: an edit that mutates an object through a call, not an assignment, must not
    be left for a later unedited cell to see (the labs' mistakes assign their answers)."""
    _, code, edited = _edited_code(solution, edits)
    sources = [c.source for c in code]
    first = min(i for i, (a, b) in enumerate(zip(sources, edited)) if a != b)
    last = _printing_cell(code, through, solution.name)
    assert first <= last, f"{solution.name}: the edits come after the cell printing {through!r}"
    kept, run, rebound, opaque = list(sources[:first]), [], set(), False
    for original, source in zip(sources[first:last + 1], edited[first:last + 1]):
        names = _names(source)
        if source != original or opaque or names is None or names[0] & rebound:
            run.append(source)
            if names is None:
                opaque = True   # what a magic binds is unknown: every later cell runs again
            else:
                rebound |= names[1]
        else:
            kept.append(original)
    return kept, run


def replay_code(cells: list[str]) -> str:
    """Python for the kernel: run `cells` in the kernel's namespace (a function defined earlier looks its names
    up there, so a copy would hide the mistake from it), then put the namespace back as it was and forget the
    grading results they add."""
    return (
        "def _nanoserve_replay(cells, ns):\n"
        "    from nanoserve.course import grading as _grading\n"
        "    before, n = dict(ns), len(_grading.results)\n"
        "    try:\n"
        "        for src in cells:\n"
        "            exec(compile(get_ipython().transform_cell(src), '<mistake replay>', 'exec'), ns)\n"
        "    except Exception as exc:\n"
        "        print(f'replay raised {type(exc).__name__}: {exc}')\n"
        "    finally:\n"
        "        del _grading.results[n:]\n"
        "        ns.clear()\n"
        "        ns.update(before)\n"
        f"_nanoserve_replay({cells!r}, get_ipython().user_ns); del _nanoserve_replay\n")


def assert_mistake_fails(solution: Path, mistake_id: str, tmp_path: Path, capsys, *, fails=(), passes=(),
                         says=()) -> None:
    """The registered mistake is graded a failure: every check in `fails` FAILs, every one in `passes` PASSes,
    and each regex in `says` (a check's verdict and detail) is in the report."""
    code, out = graded_mistake(solution, mistake_id, tmp_path, capsys)
    assert code == 1, out
    verdicts = [rf"FAIL\s+{re.escape(n)}\s" for n in fails] + [rf"PASS\s+{re.escape(n)}\s" for n in passes]
    for pattern in [*says, *verdicts]:
        assert re.search(pattern, out), f"{pattern!r} not in the report:\n{out}"


def graded_mistake(solution: Path, mistake_id: str, tmp_path: Path, capsys) -> tuple[int, str]:
    """(exit code, report) of the registered mistake: from this session's nbval run of the solution when there
    was one, else from grading an edited copy (`grade_edited_solution`). The report has the grader's format."""
    from nanoserve.course.grading import parse_line
    edits, through = MISTAKES[solution.name][mistake_id]
    text = REPLAYS.get((solution.name, mistake_id))
    if text is None:
        return grade_edited_solution(solution, edits, tmp_path, capsys, through=through)
    results = [r for r in map(parse_line, text.splitlines()) if r is not None]
    lines = [f"  {'PASS' if r.passed else 'FAIL':<6} {r.name}  {r.detail}" for r in results]
    lines += [line for line in text.splitlines() if line.startswith("replay raised")]
    failed = sum(not r.passed for r in results) or any(line.startswith("replay raised") for line in lines)
    return (1 if failed or not results else 0), "\n".join(lines)


# --- a learner's untouched lab, replayed in nbval's run of its solution ---------------------------------------
# The lab is the solution with each solution region replaced by its stub, so up to its first TODO cell a
# learner's run computes exactly what the solution's does (the model, the workload, the symptom: half its time).
# conftest.py keeps the namespace as it is just before the solution's first TODO cell runs, and after the
# solution's last cell (and its mistakes' replays) puts it back and runs the lab's cells from its first TODO on,
# each on its own, carrying on past errors as the grader does; their output and errors fill in a copy of the lab, which is then
# graded like the grader's run of it. Objects made before the first TODO are shared with the solution's run and
# are as its later cells left them (an engine that has served more requests); names are as the learner's run
# would have them. Run alone, the unsolved test grades a copy of the lab with the grader.

UNSOLVED: dict[str, Path] = {}           # solution name -> its lab
UNSOLVED_RUNS: dict[str, object] = {}    # lab name -> the lab notebook with the replay's outputs


def unsolved(solution: Path, lab: Path) -> Path:
    """Register `lab`, generated from `solution`, for conftest.py to replay in nbval's run of the solution."""
    UNSOLVED[solution.name] = lab
    return lab


def learner_cells(solution: Path, lab: Path):
    """(the lab notebook, its code cells, the index among them of the first TODO cell). Every code cell before
    that is the solution's own, so its run in the solution's kernel is the learner's."""
    nb = nbformat.read(str(lab), as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    theirs = [c.source for c in nbformat.read(str(solution), as_version=4).cells if c.cell_type == "code"]
    first = next(i for i, c in enumerate(code) if grade.is_todo_cell(c))
    assert len(code) == len(theirs) and [c.source for c in code[:first]] == theirs[:first], \
        f"{lab.name} is not generated from {solution.name}: run tools/make_labs.py"
    return nb, code, first


SNAPSHOT, LEARNER = "_nanoserve_before_todo", "_nanoserve_learner"


def snapshot_code() -> str:
    return f"{SNAPSHOT} = dict(get_ipython().user_ns)\n"


def unsolved_plan(solution: Path, lab: Path, keep: bool = True) -> list[tuple[int, bool, set[str]]]:
    """(code cell index, run it?, the names it binds) for each lab cell from the first TODO on.

    A cell runs unless it is the solution's own cell, reads no name that a TODO cell or a cell run before it
    binds, and binds nothing a later cell of the solution binds again: then it computed in the solution's run
    what it would compute in the learner's (a given measurement, seconds), and the names it binds are taken
    from the solution's namespace as they are after its last cell. The rule sees names, not objects: a cell
    that reads what a TODO cell changed through an object (a patched module's function) is kept wrongly, and
    its copied PASS lines then fail the test that reads them; keep=False runs every cell from the first TODO."""
    _, code, first = learner_cells(solution, lab)
    theirs = [c.source for c in nbformat.read(str(solution), as_version=4).cells if c.cell_type == "code"]
    later_binds = [set() for _ in theirs]
    for i in range(len(theirs) - 2, -1, -1):
        names = _names(theirs[i + 1])
        later_binds[i] = later_binds[i + 1] | (names[1] if names else {"*"})
    plan, learner_only = [], set()
    for i in range(first, len(code)):
        names, ours = _names(code[i].source), _names(theirs[i])
        kept = (keep and code[i].source == theirs[i] and names is not None and not names[0] & learner_only
                and not names[1] & later_binds[i] and "*" not in later_binds[i])
        if not kept:
            learner_only |= (names[1] if names else set()) | (ours[1] if ours else set())
        plan.append((i, not kept, names[1] if names else set()))
    return plan


def learner_start_code() -> str:
    """Put the kernel's namespace back as it was before the first TODO cell (functions defined earlier look
    their names up there, so the learner's run must use that very namespace, not a copy), keeping the
    solution's final one aside for the kept cells' names, and the count of grading results so far."""
    return ("def _nanoserve_learner_start(ns):\n"
            "    from nanoserve.course import grading\n"
            "    final = dict(ns)\n"
            "    ns.clear()\n"
            f"    ns.update(final.pop({SNAPSHOT!r}))\n"
            f"    ns[{LEARNER!r}] = (final, len(grading.results))\n"
            "_nanoserve_learner_start(get_ipython().user_ns)\n")


def learner_cell_code(source: str) -> str:
    """Run one lab cell in the learner's namespace; print what it raised."""
    return (
        "def _nanoserve_learner_cell(src):\n"
        "    import linecache\n"
        "    code = get_ipython().transform_cell(src)\n"
        "    name = f'<lab cell {len(linecache.cache)}>'   # in linecache, as IPython's cells: inspect finds the source\n"
        "    linecache.cache[name] = (len(code), None, code.splitlines(True), name)\n"
        "    try:\n"
        "        exec(compile(code, name, 'exec'), get_ipython().user_ns)\n"
        "    except Exception as exc:\n"
        f"        print({LEARNER_ERROR!r} + repr((type(exc).__name__, str(exc))))\n"
        f"_nanoserve_learner_cell({source!r}); del _nanoserve_learner_cell\n")


def learner_keep_code(names: set[str]) -> str:
    """Give the learner's namespace a kept cell's names, as the solution's run left them."""
    return (f"get_ipython().user_ns.update({{n: v for n, v in {LEARNER}[0].items() if n in {sorted(names)!r}}})\n")


def learner_end_code() -> str:
    """Forget the grading results the learner's cells added (the namespace stays the learner's: nothing runs
    after it)."""
    return f"from nanoserve.course import grading as _g\ndel _g.results[{LEARNER}[1]:], {LEARNER}, _g\n"


def replay_learner(run, solution: Path, lab: Path, code, first: int, printed: list[str], keep: bool = True) -> None:
    """Fill the lab's code cells (`code`, `first`: from learner_cells) with a learner's run, replayed in a kernel
    that has just run the solution and kept the snapshot before its first TODO cell. run(python) executes in
    that kernel and returns what it printed; printed[i] is what the solution's code cell i printed; keep: see
    `unsolved_plan`."""
    for cell, text in zip(code[:first], printed):
        fill_outputs(cell, text)
    run(learner_start_code())
    for i, rerun, binds in unsolved_plan(solution, lab, keep):
        if rerun:
            fill_outputs(code[i], run(learner_cell_code(code[i].source)))
        else:   # the solution's own cell, which computed what the learner's would: its output and its names
            fill_outputs(code[i], printed[i])
            run(learner_keep_code(binds))
    run(learner_end_code())


LEARNER_ERROR = "<<lab cell raised>> "


def fill_outputs(cell, printed: str) -> None:
    """Set a lab cell's outputs from what its replay printed: its stdout, and its error (if it raised)."""
    lines = printed.split("\n")
    raised = [line for line in lines if line.startswith((LEARNER_ERROR, "replay raised "))]
    text = "\n".join(line for line in lines if line not in raised)
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)] if text.strip() else []
    for line in raised:   # what the cell raised; "replay raised": what escaped it (an interrupt)
        ename, evalue = (ast.literal_eval(line[len(LEARNER_ERROR):]) if line.startswith(LEARNER_ERROR)
                         else line[len("replay raised "):].split(": ", 1) + [""])[:2]
        cell.outputs.append(nbformat.v4.new_output("error", ename=ename, evalue=evalue, traceback=[]))
