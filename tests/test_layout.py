"""The package's shape, read from its files: no import circle, no import from a lower layer to a
higher one, no module over 700 lines."""
import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "pfa_numba"

#: layers, lowest first: a module may import its own layer's modules and lower ones only
LAYERS = [
    ("config", "cache", "numerics", "reference", "interop"),   # numerics, the float64 meaning,
                                                      # arrays, Numba's cache
    ("variant", "cpu", "gpu"),                        # kernel variants; the backends (packages)
    ("frontend",),                                    # the call: checks, the problem
    ("dispatch", "plans"),                            # choosing a backend; plans of calls
    ("api", "fia", "merge", "sdpa"),                  # the public functions
    ("distributed", "__init__", "integrations"),      # other libraries' calls onto the API
    ("cli", "__main__"),                              # the command line and its benchmarks
]
#: the top level: these modules beside the packages (dunder files aside)
TOP_LEVEL = {"api", "fia", "sdpa", "merge", "config", "cache", "variant", "distributed",
             "dispatch", "plans"}
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules():
    mods = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(PKG).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(name, path, mods):
    """Modules of the package that ``name`` imports (at module level or inside functions)."""
    package = name.split(".")[:-1] if path.name != "__init__.py" else name.split(".")
    if name == "__init__":
        package = []
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - (node.level - 1)]
            target = base + (node.module.split(".") if node.module else [])
            for alias in node.names:
                full = ".".join(target + [alias.name])
                found.add(full if full in mods else ".".join(target))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            for n in names:
                if n and n.startswith("pfa_numba."):
                    found.add(n[len("pfa_numba."):])
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "__import__"
              and node.args and isinstance(node.args[0], ast.Constant)
              and str(node.args[0].value).startswith("pfa_numba.")):
            found.add(node.args[0].value[len("pfa_numba."):])
    return {m if m else "__init__" for m in found if (m if m else "__init__") in mods} - {name}


def _graph():
    mods = _modules()
    mods["__init__"] = mods.pop("") if "" in mods else PKG / "__init__.py"
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _layer(name):
    top = name.split(".")[0]
    if top not in LAYER:
        raise AssertionError(f"module {name} has no layer in tests/test_layout.py")
    return LAYER[top]


def test_no_import_from_a_lower_layer_to_a_higher_one():
    graph = _graph()
    bad = [f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
           for a, deps in graph.items() for b in deps
           if _layer(b) > _layer(a) and not b.startswith(a + ".")]
    assert not bad, bad


def _circles(graph):
    """Modules from which an import chain leads back to themselves (a package importing its
    own modules, cpu -> cpu.driver, is not a chain: that edge is left out)."""
    edges = {a: {b for b in deps if not b.startswith(a + ".")} for a, deps in graph.items()}

    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    return sorted(a for a in edges if a in reach(a))


def test_no_import_circle():
    assert not _circles(_graph())


def test_the_checks_see_a_circle_and_a_layer_breach():
    graph = _graph()
    graph["numerics.core"] = graph["numerics.core"] | {"api"}   # as if it imported api
    assert "numerics.core" in _circles(graph) and "api" in _circles(graph)
    assert _layer("api") > _layer("numerics.core")


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(PKG)))
def test_no_module_over_700_lines(path):
    assert len(path.read_text().splitlines()) <= 700


def test_the_top_level_holds_the_public_modules_and_packages_only():
    files = {p.stem for p in PKG.glob("*.py") if not p.stem.startswith("__")}
    assert files == TOP_LEVEL and len(files) <= 10, files
    packages = {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}
    assert all(_layer(name) is not None for name in packages | files)
