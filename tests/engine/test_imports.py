"""`import nanoserve` loads the engine only: it changes no environment variable, loads neither the course
tooling nor the profiler's analysis, and nanoserve's modules import each other without a cycle."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "nanoserve"


def fresh_python(code: str):
    """Run `code` in a new interpreter (nothing imported yet) and return the JSON it printed last."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_leaves_the_environment_alone():
    changed = fresh_python(
        "import json, os\n"
        "before = dict(os.environ)\n"
        "import nanoserve\n"
        "keys = set(before) | set(os.environ)\n"
        "print(json.dumps({k: [before.get(k), os.environ.get(k)] for k in sorted(keys)"
        " if before.get(k) != os.environ.get(k)}))")
    assert changed == {}, f"import nanoserve changed os.environ (name: [before, after]): {changed}"


def test_import_loads_the_engine_only():
    # torch itself imports torch.profiler, so count only what `import nanoserve` adds after `import torch`
    added = fresh_python(
        "import json, sys, torch\n"
        "before = set(sys.modules)\n"
        "import nanoserve\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))")
    unwanted = [m for m in added if m.startswith(("nanoserve.course", "torch.profiler", "matplotlib", "transformers",
                                                  "nanoserve.perf.profile", "nanoserve.perf.trace"))]
    assert not unwanted, f"import nanoserve loaded modules the engine does not need: {unwanted}"


def test_subpackages_load_on_first_use():
    got = fresh_python(
        "import json, sys\n"
        "import nanoserve\n"
        "assert 'nanoserve.course' not in sys.modules\n"
        "course = nanoserve.course.__name__\n"
        "from nanoserve import perf\n"
        "import nanoserve.perf.profile, nanoserve.perf.roofline\n"   # submodules named like perf's functions
        "print(json.dumps([course, callable(perf.profile), callable(nanoserve.perf.roofline), perf.timeit.__name__,"
        " hasattr(nanoserve, 'no_such_module')]))")
    assert got == ["nanoserve.course", True, True, "timeit", False]


# --- no import cycle --------------------------------------------------------------------------------

def module_names(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `package_dir` (a package is its __init__.py)."""
    names = {}
    for file in package_dir.rglob("*.py"):
        parts = list(file.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = file
    return names


def _imported_names(tree: ast.AST, module: str, is_package: bool):
    """(name, fallback) for every name an import statement in `tree` asks for, at module level or inside a
    function (a function-level import is still an arrow, only a later one), except under `if TYPE_CHECKING:`.
    `from a import b` gives ("a.b", "a"): a.b if it is a module, else a name defined in a."""
    def skipped(node):
        test = node.test if isinstance(node, ast.If) else None
        return test is not None and (getattr(test, "id", None) == "TYPE_CHECKING"
                                     or getattr(test, "attr", None) == "TYPE_CHECKING")

    stack = [tree]
    while stack:
        node = stack.pop()
        if skipped(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            yield from ((alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:   # relative: from the module's own package, up level - 1 packages
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            yield from ((f"{base}.{alias.name}", base) for alias in node.names)
        stack.extend(ast.iter_child_nodes(node))


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports. `from a import b` points at a.b when that is a module,
    else at a; an import never points at the importing module itself."""
    modules = module_names(package_dir)
    graph = {}
    for name, file in modules.items():
        targets = set()
        tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
        for wanted, fallback in _imported_names(tree, name, file.name == "__init__.py"):
            if wanted in modules:
                targets.add(wanted)
            elif fallback in modules:
                targets.add(fallback)
        graph[name] = targets - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None when the graph is acyclic (depth-first search)."""
    state: dict[str, str] = {}   # "open" while on the current path, "done" after
    path: list[str] = []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_nanoserve_has_no_import_cycle():
    cycle = find_cycle(import_graph(PACKAGE))
    assert cycle is None, "import cycle among nanoserve's modules: " + " -> ".join(cycle)


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root / "pkg"


@pytest.mark.parametrize("files, cycle", [
    # the circle perf/profile.py and perf/profile_plots.py once made, each import inside a function
    ({"pkg/__init__.py": "", "pkg/perf/__init__.py": "",
      "pkg/perf/profile.py": "def plot(p):\n    from pkg.perf.profile_plots import plot_timeline\n",
      "pkg/perf/profile_plots.py": "def plot_timeline(p):\n    from pkg.perf.profile import _union\n"},
     ["pkg.perf.profile", "pkg.perf.profile_plots", "pkg.perf.profile"]),
    # llm.py and the package's __init__ importing each other; a relative import
    ({"pkg/__init__.py": "from pkg.llm import LLM\nMODEL = 'x'\n",
      "pkg/llm.py": "class LLM:\n    def __init__(self):\n        from . import MODEL\n"},
     ["pkg", "pkg.llm", "pkg"]),
    # `from pkg import sub` points at the submodule, not at the package: no cycle
    ({"pkg/__init__.py": "from pkg.a import f\n", "pkg/a.py": "def f():\n    from pkg import b\n", "pkg/b.py": ""},
     None),
    # imports for type checkers only are not arrows
    ({"pkg/__init__.py": "", "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n",
      "pkg/b.py": "from pkg.a import A\n"}, None),
])
def test_the_cycle_check_finds_real_cycles_only(tmp_path, files, cycle):
    assert find_cycle(import_graph(_write_package(tmp_path, files))) == cycle
