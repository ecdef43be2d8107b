"""The package's layout holds: no import circles, no import up the layers (LAYERS, bottom-up), the server
only through the offline facade, no module calling another module's private names, and nothing in the
package importing the checkout's `tools/` (they are not installed). The tests' layout holds too: test
files in folders (one per layer of the package), and no test module importing another (shared code lives
in helper modules such as tests/utils.py, fixtures in conftest.py).

Imports are read from the source with `ast` (type-only imports under TYPE_CHECKING and imports inside
functions count too), so a failure names the modules and lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
PACKAGE = REPO / "conveyor"
TOOLS = REPO / "tools"

# Bottom-up; a module imports from its own layer and the layers below it. A prefix names a module or a
# folder of them; the package root (`conveyor`, the public API) is the "api" layer.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("kernels", ("conveyor.kernels",)),
    ("base", ("conveyor.errors", "conveyor.sampling_params", "conveyor.pooling_params", "conveyor.lora_request",
              "conveyor.reasoning_state", "conveyor.request")),
    ("cache", ("conveyor.cache",)),
    ("sched", ("conveyor.sched",)),
    ("structured", ("conveyor.structured",)),
    ("tool_parsers", ("conveyor.tool_parsers",)),
    ("reasoning", ("conveyor.reasoning",)),
    ("layers", ("conveyor.layers",)),
    ("models", ("conveyor.models",)),
    ("speculative", ("conveyor.speculative",)),
    ("config", ("conveyor.config",)),
    ("engine", ("conveyor.engine",)),
    ("distributed", ("conveyor.distributed",)),
    ("api", ("conveyor.manager", "conveyor.metrics", "conveyor.enqueue_llm", "conveyor.engine_view",
             "conveyor.pooling_llm", "conveyor.lora_llm", "conveyor.beam_search", "conveyor.chat_llm", "conveyor.llm",
             "conveyor.cli_args",
             "conveyor.chat_template", "conveyor.generation_config", "conveyor.vllm_flags")),
    ("server", ("conveyor.server",)),
    ("scaleout", ("conveyor.scaleout",)),
    ("bench", ("conveyor.bench",)),
    ("cli", ("conveyor.cli",)),
]
# What the server may import of the package: the facade and the types requests are made of.
SERVER_ALLOWED = ("conveyor", "conveyor.llm", "conveyor.manager", "conveyor.metrics", "conveyor.errors",
                  "conveyor.request", "conveyor.sampling_params", "conveyor.pooling_params", "conveyor.lora_request",
                  "conveyor.structured", "conveyor.tool_parsers", "conveyor.reasoning", "conveyor.server")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(name: str) -> str:
    """The module a dotted name lives in (a name imported from a module resolves to that module)."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def imports(module: str) -> list[tuple[str, int]]:
    """(imported module, line) for every import of the package in `module`."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(resolve(a.name), node.lineno) for a in node.names if a.name.split(".")[0] == "conveyor"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "conveyor":
                continue
            for alias in node.names:
                full = f"{source}.{alias.name}"
                found.append((full if full in MODULES else resolve(source), node.lineno))
    return [(m, line) for m, line in found if m != module]


GRAPH = {m: imports(m) for m in MODULES}


def layer_of(module: str) -> int:
    if module == "conveyor":
        return next(i for i, (name, _) in enumerate(LAYERS) if name == "api")
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} is in no layer of LAYERS: add it to one")


def find_cycle(graph: dict[str, list[tuple[str, int]]]) -> list[str] | None:
    """One import circle, as the modules around it, or None."""
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for dep, _ in graph.get(m, []):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in graph:
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def upward(graph: dict[str, list[tuple[str, int]]]) -> list[str]:
    return [f"{m} (line {line}, layer {LAYERS[layer_of(m)][0]}) imports {dep} (layer {LAYERS[layer_of(dep)][0]})"
            for m, deps in graph.items() for dep, line in deps if layer_of(dep) > layer_of(m)]


def test_the_checks_see_what_they_police():
    """The reader finds the imports, and the checks flag a circle and an upward import when there is one."""
    engine = {dep for dep, _ in GRAPH["conveyor.engine.engine"]}
    assert {"conveyor.sched.scheduler", "conveyor.cache.pool", "conveyor.engine.model_runner"} <= engine
    assert "conveyor" in {dep for dep, _ in GRAPH["conveyor.server.metrics"]}  # `from .. import EngineStats`
    bad = {"conveyor.sched.scheduler": [("conveyor.engine.engine", 1)],
           "conveyor.engine.engine": [("conveyor.sched.scheduler", 2)]}
    assert find_cycle(bad) == ["conveyor.sched.scheduler", "conveyor.engine.engine", "conveyor.sched.scheduler"]
    assert upward(bad) == ["conveyor.sched.scheduler (line 1, layer sched) imports conveyor.engine.engine "
                           "(layer engine)"]


def test_no_import_circles():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_every_module_is_in_a_layer():
    for module in MODULES:
        layer_of(module)


def test_no_import_runs_up_the_layers():
    found = upward(GRAPH)
    assert not found, "imports up the layers:\n" + "\n".join(found)


def test_the_server_uses_the_facade_only():
    reaching = [f"{m} (line {line}) imports {dep}" for m, deps in GRAPH.items() if m.startswith("conveyor.server")
                for dep, line in deps if not any(dep == a or dep.startswith(a + ".") for a in SERVER_ALLOWED)]
    assert not reaching, "the server reaches past the facade:\n" + "\n".join(reaching)


def private_names(tree: ast.AST) -> set[str]:
    """Names starting with one underscore that a module defines: functions, classes, methods, attributes."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def private_uses(trees: dict[str, ast.AST]) -> list[str]:
    """Imports of underscore names, and `obj._name` where `_name` is private to another module of the package."""
    defined = {m: private_names(t) for m, t in trees.items()}
    elsewhere = {name for names in defined.values() for name in names}
    found = []
    for m, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                found += [f"{m} (line {node.lineno}) imports {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
            elif (isinstance(node, ast.Attribute) and node.attr in elsewhere and node.attr not in defined[m]
                  and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                found.append(f"{m} (line {node.lineno}) uses {ast.unparse(node)}")
    return found


def tools_imports(tree: ast.AST) -> list[int]:
    """Lines that import the top-level `tools` folder (`import tools...`, `from tools... import ...`)."""
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "tools" for a in node.names)
            or isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "tools"]


def test_tools_imports_are_found():
    tree = ast.parse("import tools.roofline\nfrom tools import fuzz\nfrom .tools import x\nimport toolset\n"
                     "def f():\n    from tools.simulate.cli import main\n")
    assert tools_imports(tree) == [1, 2, 6]


def test_the_package_never_imports_the_tools():
    """Tools import the package, never the reverse: an installed `conveyor` has no `tools` to import."""
    found = [f"{m} (line {line}) imports tools" for m, p in MODULES.items()
             for line in tools_imports(ast.parse(p.read_text()))]
    assert not found, "the package imports the checkout's tools/:\n" + "\n".join(found)


def test_private_uses_are_found():
    trees = {"a": ast.parse("class E:\n    def _finish(self): self._n = 1\n"),
             "b": ast.parse("def f(engine):\n    engine._finish()\n    return engine._n, engine.config._other\n")}
    assert private_uses(trees) == ["b (line 2) uses engine._finish", "b (line 3) uses engine._n"]


def test_no_module_uses_another_modules_private_names():
    """The package's modules and the tools' (which use the package from outside)."""
    tools = {".".join(p.relative_to(TOOLS.parent).with_suffix("").parts): p for p in sorted(TOOLS.rglob("*.py"))}
    found = private_uses({m: ast.parse(p.read_text()) for m, p in (MODULES | tools).items()})
    assert not found, "private names used across modules:\n" + "\n".join(found)


# -- the tests ------------------------------------------------------------------------------------
def dotted(path: Path) -> str:
    """The module name of a file of the repository (tests/cache/test_cache.py: tests.cache.test_cache)."""
    return ".".join(path.relative_to(REPO).with_suffix("").parts)


def imports_of_test_modules(source: str, module: str) -> list[tuple[str, int]]:
    """(test module or conftest, line) for every import of one in `source`, the code of `module` (dotted, from
    the repository root): `from .test_x import f`, `from tests.cache import test_cache`, `import tests.conftest`."""
    package = module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            source_module = ".".join(base + ([node.module] if node.module else []))
            found += [(source_module, node.lineno)] + [(f"{source_module}.{a.name}", node.lineno) for a in node.names]
    return [(name, line) for name, line in found if name.split(".")[0] == "tests"
            and name.rpartition(".")[2].startswith(("test_", "conftest"))
            and REPO.joinpath(*name.split(".")).with_suffix(".py").is_file()]


def test_the_test_checks_see_what_they_police():
    source = ("from .test_cache import check\nfrom ..sched import test_scheduler\nimport tests.conftest\n"
              "from tests.utils import greedy\nfrom . import test_offload\n")
    assert imports_of_test_modules(source, "tests.cache.test_prefix_cache") == [
        ("tests.cache.test_cache", 1), ("tests.sched.test_scheduler", 2), ("tests.conftest", 3),
        ("tests.cache.test_offload", 5)]


def test_no_test_module_imports_another():
    """Tests share code through helper modules and fixtures: a test module imported by another one runs its
    module-level code twice under two names, and ties the two files' contents together."""
    found = [f"{path.relative_to(REPO)} (line {line}) imports {name}" for path in sorted(TESTS.rglob("*.py"))
             for name, line in imports_of_test_modules(path.read_text(), dotted(path))]
    assert not found, "test modules imported (move what they share into a helper module):\n" + "\n".join(found)


def test_test_files_live_in_folders():
    """tests/<folder>/test_*.py, each folder a package (so that two folders may hold files of the same name)."""
    top = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert not top, f"test files at the top of tests/ (put them in the folder of the layer they test): {top}"
    missing = sorted({str(p.parent.relative_to(REPO)) for p in TESTS.rglob("test_*.py")
                      if not (p.parent / "__init__.py").is_file()})
    assert not missing, f"test folders without __init__.py: {missing}"
