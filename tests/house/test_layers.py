"""Layers one way (design.md, "Layers"): every import of posttrain/ points down the list, and no
two modules import each other, directly or round a longer loop.

Every module is parsed with ``ast`` (nothing is imported), so lazy imports inside functions count
as much as top-level ones. An import names the module it reads: ``from posttrain.a.b import c``
is an edge to ``posttrain.a.b.c`` when that is a module, else to ``posttrain.a.b``; the implicit
import of a parent package's ``__init__`` is not an edge. Imports by string
(``importlib.import_module``: user reward targets, the trainer registry) are not seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
Graph = dict[str, dict[str, int]]  # module -> {imported module: line of the first import}
FILES: dict[str, str] = {}  # module -> its file, relative to the root, for the messages

# each layer may import only from itself and the layers before it
LAYERS = ("core", "config", "ops", "data", "models", "sandbox", "rollout", "rewards", "search",
          "engine", "trainers", "cli", "tasks")
# modules outside a sub-package of the same name
MODULE_LAYERS = {"posttrain": "core", "posttrain.cli": "cli", "posttrain.__main__": "cli",
                 "posttrain.demo": "tasks"}
# (importer, imported): why this upward import is the right one
ALLOWED_UP = {
    # `posttrain demo` is the command line's entry into the demo world: one lazy import in the
    # command's handler, so nothing below the CLI (and not `import posttrain.cli` either) loads it
    ("posttrain.cli", "posttrain.demo"): "the `posttrain demo` command",
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    if module in MODULE_LAYERS:
        return MODULE_LAYERS[module]
    layer = module.split(".")[1]
    if layer not in LAYERS:
        raise AssertionError(f"{module}: package posttrain.{layer} has no layer in LAYERS; add "
                             "it where it belongs (tests/house/test_layers.py and design.md)")
    return layer


def imports(path: Path, module: str, known: set[str]) -> list[tuple[str, int]]:
    """(imported posttrain module, line) for every import statement in the file at ``path``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub if sub in known else base, node.lineno))
    return [(name, line) for name, line in out if name == "posttrain"
            or name.startswith("posttrain.")]


def import_graph(root: Path) -> Graph:
    """module -> {imported module: first line}, over every module under ``root``/posttrain."""
    files = {module_name(p, root): p for p in sorted((root / "posttrain").rglob("*.py"))}
    FILES.update({m: str(p.relative_to(root)) for m, p in files.items()})
    known = set(files)
    graph: Graph = {}
    for module, path in files.items():
        edges: dict[str, int] = {}
        for target, line in imports(path, module, known):
            if target not in known:
                raise AssertionError(f"{path.relative_to(root)}:{line}: imports {target}, "
                                     "which is not a module of posttrain")
            if target != module:
                edges.setdefault(target, line)
        graph[module] = edges
    return graph


def upward_imports(graph: Graph) -> list[str]:
    bad = []
    for module, edges in graph.items():
        for target, line in edges.items():
            src, dst = layer_of(module), layer_of(target)
            if LAYERS.index(dst) > LAYERS.index(src) and (module, target) not in ALLOWED_UP:
                bad.append(f"{FILES[module]}:{line} (layer {src}) imports {target} "
                           f"(layer {dst}, later in the list)")
    return bad


def cycles(graph: Graph) -> list[list[str]]:
    """One cycle (a closed path of modules) per strongly connected group (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_closed_path(graph, set(g), min(g)) for g in groups]


def _closed_path(graph: Graph, group: set[str], start: str) -> list[str]:
    """A path start -> ... -> start inside ``group`` (breadth first, so a shortest one)."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    return [*paths[v], start]
                if w in group and w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # pragma: no cover


def describe(graph: Graph, cycle: list[str]) -> str:
    pairs = zip(cycle[:-1], cycle[1:], strict=True)
    return " -> ".join(f"{FILES[a]}:{graph[a][b]} imports {b}" for a, b in pairs)


@pytest.fixture(scope="module")
def graph() -> Graph:
    return import_graph(ROOT)


def test_every_import_points_down_the_layers(graph: Graph) -> None:
    bad = upward_imports(graph)
    assert not bad, "imports against the layer order (design.md, Layers):\n" + "\n".join(bad)


def test_no_import_cycle(graph: Graph) -> None:
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(describe(graph, c) for c in found)


def test_every_allowed_exception_is_still_needed(graph: Graph) -> None:
    stale = [pair for pair in ALLOWED_UP if pair[1] not in graph.get(pair[0], {})]
    assert not stale, f"ALLOWED_UP lists imports that no longer exist: {stale}"


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / "posttrain" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checks_catch_an_upward_lazy_import_and_a_cycle(tmp_path: Path) -> None:
    """The control: a small fake package with the faults the real one must not have."""
    root = _write(tmp_path, {
        "__init__.py": "",
        "data/__init__.py": "",
        "data/schemas.py": "def check():\n    from posttrain.rewards.code import x\n",
        "rewards/__init__.py": "",
        "rewards/code.py": "x = 1\n",
        "rollout/__init__.py": "",
        "rollout/a.py": "from posttrain.rollout.b import y\n",
        "rollout/b.py": "def f():\n    from . import a\n",
    })
    fake = import_graph(root)
    assert upward_imports(fake) == [
        "posttrain/data/schemas.py:2 (layer data) imports posttrain.rewards.code "
        "(layer rewards, later in the list)"]
    found = {tuple(c) for c in cycles(fake)}
    assert found == {("posttrain.rollout.a", "posttrain.rollout.b", "posttrain.rollout.a")}
    assert describe(fake, list(found.pop())) == (
        "posttrain/rollout/a.py:1 imports posttrain.rollout.b -> "
        "posttrain/rollout/b.py:2 imports posttrain.rollout.a")


# rollout/ receives values, not callbacks: a callable it is handed is the user's (a tool, an
# environment's method) or a collective, never a trainer's or the engine's method
ROLLOUT_CALLABLES = {
    ("tools.py", "tool_schemas", "fns"): "the user's tool functions",
    ("tools.py", "_run_one", "fns"): "the user's tool functions",
    ("tools.py", "call_tools", "jobs"): "the user's tool functions",
    ("tools.py", "__init__", "fns"): "the user's tool functions (an episode's `Toolbox`)",
    ("tools.py", "_spawn", "fn"): "tools.py's own call runner, on a thread",
    ("vllm_server.py", "__init__", "barrier"): "torch.distributed's barrier (a collective)",
    ("vllm_server.py", "__init__", "fn"): "vllm_server.py's own request or NCCL join/send",
    ("vllm_server.py", "_run", "fn"): "vllm_server.py's own request or NCCL join/send",
    ("vllm_server.py", "run", "block"): "vllm_server.py's own NCCL join/send, bounded in time",
}


def callable_parameters(root: Path) -> dict[tuple[str, str, str], int]:
    """(file, function, parameter) -> line, for every parameter of a function under
    ``root``/posttrain/rollout annotated with a `Callable`."""
    out = {}
    for path in sorted((root / "posttrain" / "rollout").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                for arg in args:
                    if arg.annotation is not None and "Callable" in ast.unparse(arg.annotation):
                        out[(path.name, node.name, arg.arg)] = arg.lineno
    return out


def test_rollout_never_calls_back_up() -> None:
    """Nothing under rollout/ imports trainers/ or engine/ (the layer order) nor takes a
    callback from them: every Callable parameter is a user's tool or a collective."""
    found = callable_parameters(ROOT)
    extra = {k: v for k, v in found.items() if k not in ROLLOUT_CALLABLES}
    assert not extra, f"rollout/ takes callables (a call back up?): {extra}"
    assert set(ROLLOUT_CALLABLES) <= set(found), "ROLLOUT_CALLABLES lists stale entries"


def test_a_callback_into_rollout_is_caught(tmp_path: Path) -> None:
    """The control: an episode loop handed the trainer's render method."""
    root = _write(tmp_path, {"rollout/episodes.py": (
        "from collections.abc import Callable\n"
        "def run(render: Callable[[list], str]) -> None:\n    pass\n")})
    assert callable_parameters(root) == {("episodes.py", "run", "render"): 2}
