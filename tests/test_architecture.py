"""The structure docs/ARCHITECTURE.md describes, checked: no import circles (every import counts, those inside
functions and under TYPE_CHECKING too), no module-level mutable state, functions within their line budget, the
scheduler never imports torch, no family string checks outside the family adapters, and no history (issue or
session numbers) in src/'s comments and docstrings or in the map itself."""

import ast
import io
import pathlib
import re
import tokenize

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "diffgraph"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The diffgraph modules `name` imports (the named module itself, not the packages above it)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod
            targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def test_the_import_graph_has_no_circle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # packages re-export their modules (diffgraph/__init__ imports the engine ...): an edge into a package is an
    # edge into its __init__ only, and modules never import a package __init__ that imports them back
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert "diffgraph.engine.model_runner" in graph["diffgraph.engine.core"]  # the walk sees real edges


def _package(name: str) -> str:
    """A module's layer unit: its subpackage of diffgraph (diffgraph.engine), or the top-level module itself."""
    return ".".join(name.split(".")[:2])


OPEN_CIRCLES: set[frozenset[str]] = set()  # none: what the server and batch jobs share is diffgraph.api, below both


def test_no_import_runs_back_up_the_layers():
    """Between packages (and top-level modules) the imports form layers: no circle, so none runs back up. Circles
    inside a package are the module test's above."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        for target in _imports(name, path, modules):
            a, b = _package(name), _package(target)
            if a != b and b != "diffgraph":  # the root package re-exports the API (nothing below imports it)
                graph.setdefault(a, set()).add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def strong(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    assert set(circles) <= OPEN_CIRCLES, f"imports that run back up: {[sorted(c) for c in circles]}"
    assert "diffgraph.engine" in graph["diffgraph.server"]  # the walk sees real edges


def test_no_module_level_mutable_state():
    offenders = []
    for name, path in _modules().items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
                value = node.value
                mutable = isinstance(value, (ast.List, ast.Dict, ast.Set)) or (
                    isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", ""))
                    in ("dict", "list", "set", "OrderedDict", "defaultdict", "count", "deque"))
                # UPPER_CASE tables are constants by convention (never assigned to after import); __all__ too
                if mutable and any(not (n.isupper() or n == "__all__") for n in names):
                    offenders.append(f"{name}: {names}")
            if isinstance(node, ast.Global):
                offenders.append(f"{name}: global {node.names}")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Global):
                offenders.append(f"{name}: global {node.names}")
            if isinstance(node, ast.FunctionDef) and any(
                    getattr(d, "id", getattr(d, "attr", "")) in ("lru_cache", "cache") for d in node.decorator_list):
                offenders.append(f"{name}: cached function {node.name} (process-wide state)")
    assert offenders == []


FUNCTION_LINES = 80  # a function's budget; the longer ones are named in docs/ARCHITECTURE.md with the reason


def _long_functions() -> set[str]:
    """`path:qualified name` of every function in src/ over the budget (decorators not counted)."""
    out = set()
    for path in SRC.rglob("*.py"):
        def walk(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = prefix + child.name
                    if not isinstance(child, ast.ClassDef) and child.end_lineno - child.lineno + 1 > FUNCTION_LINES:
                        out.add(f"{path.relative_to(SRC).as_posix()}:{name}")
                    walk(child, name + ".")
        walk(ast.parse(path.read_text()), "")
    return out


def _named_long_functions(text: str) -> set[str]:
    """The `path:qualified name` entries of the map's "## Functions over 80 lines" section (none without one)."""
    start = text.find("## Functions over 80 lines")
    if start < 0:
        return set()
    section = text[start:]
    end = section.find("\n## ", 3)
    return set(re.findall(r"`([\w/]+\.py:[\w.]+)`", section if end < 0 else section[:end]))


def test_the_long_function_list_is_read_from_its_section():
    text = ("# Map\n\n## Functions over 80 lines\n\n- `cli.py:main`, `engine/engine.py:Engine.__init__`: why.\n\n"
            "## How to add ...\n\n`cli.py:other` is not in the list\n")
    assert _named_long_functions(text) == {"cli.py:main", "engine/engine.py:Engine.__init__"}
    assert _named_long_functions("# Map\n\n## Functions over 80 lines\n\n- `request.py:f`: why.\n") == {"request.py:f"}
    assert _named_long_functions("# Map\n\n## How to add ...\n\n- `cli.py:main`\n") == set()


def test_functions_stay_within_their_budget():
    """No function over FUNCTION_LINES lines unless docs/ARCHITECTURE.md names it with its reason, in a section
    "## Functions over 80 lines" (there is none while every function fits); a named one that was split leaves the
    list (the list is what is, not what was)."""
    text = (SRC.parents[1] / "docs" / "ARCHITECTURE.md").read_text()
    named = _named_long_functions(text)
    long = _long_functions()
    assert long - named == set(), f"functions over {FUNCTION_LINES} lines: split them, or name each with its reason"
    assert named - long == set(), "named in docs/ARCHITECTURE.md but no longer over the budget: take them off"


def test_the_scheduler_never_imports_torch():
    for name in ("scheduler.py", "scheduler_config.py", "priority.py", "request_state.py"):
        text = (SRC / "engine" / name).read_text()
        assert not re.search(r"^\s*(import torch|from torch)", text, re.M), name


def test_family_checks_live_in_the_adapters():
    """No `family == "sdxl"` style checks outside models/families/ (a new family must need no edits there)."""
    offenders = []
    for name, path in _modules().items():
        if ".models.families" in name:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"family\s*(==|!=|in)\s*|[\"']sdxl[\"']\s*(==|!=|in)", line):
                offenders.append(f"{name}:{i}: {line.strip()}")
    assert offenders == []


def test_tables_keyed_by_family_names_live_in_the_adapters():
    """No dict keyed by a family name ({"sd": ..., "sdxl": ...}) outside models/families/: what a family means is its
    adapter's attribute (a table elsewhere is an edit a new family would need, and the family check above misses)."""
    names = {"sd", "sdxl"}
    offenders = []
    for name, path in _modules().items():
        if ".models.families" in name:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Dict) and any(
                    isinstance(k, ast.Constant) and k.value in names for k in node.keys if k is not None):
                offenders.append(f"{name}:{node.lineno}")
    assert offenders == []


HISTORY = re.compile(r"\b(issue|session)s?\s+#?\d+", re.I)  # "issue 27", "(issue 32)", "sessions 8", "session #9"


def _comments_and_docstrings(path: pathlib.Path):
    """(line, text) of every comment and docstring of a module."""
    text = path.read_text()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield node.body[0].lineno, doc


def test_no_issue_or_session_numbers_in_src_comments():
    """Comments and docstrings say what and why; which issue or work session brought a line in is history, kept in
    git and BENCHMARKS.md (a figure that justifies a choice is one clause and a pointer to its BENCHMARKS.md section)."""
    hits = [f"{path.relative_to(SRC).as_posix()}:{line}: {m.group(0)!r}"
            for path in sorted(SRC.rglob("*.py")) for line, text in _comments_and_docstrings(path)
            for m in HISTORY.finditer(text)]
    assert hits == [], "drop the issue / session citations:\n" + "\n".join(hits)


def test_the_map_holds_no_issue_or_session_numbers():
    """docs/ARCHITECTURE.md is a map of what is; history goes to BENCHMARKS.md or the git log."""
    text = (SRC.parents[1] / "docs" / "ARCHITECTURE.md").read_text()
    hits = [f"line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}" for m in HISTORY.finditer(text)]
    assert hits == [], "docs/ARCHITECTURE.md cites issues or sessions:\n" + "\n".join(hits)
