"""The import structure of the product, read from its syntax trees: no cycles (function-level imports included),
imports run one way (cli -> executor -> planner -> cost_models, and inside cost_models records -> cost ->
torch_compat -> models -> profiling), and pure cost code reaches neither torch nor a probe."""
import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cost_models", "planner", "executor")
# each room, lowest first, and the rooms it may import (itself included)
ROOMS = {
    "cost_models.records": ("cost_models.records",),
    "cost_models.cost": ("cost_models.records", "cost_models.cost"),
    "cost_models.torch_compat": ("cost_models.records", "cost_models.torch_compat"),
    "cost_models.models": ("cost_models.records", "cost_models.torch_compat", "cost_models.models"),
    "cost_models.profiling": ("cost_models.records", "cost_models.cost", "cost_models.torch_compat",
                              "cost_models.models", "cost_models.profiling"),
    "planner": ("cost_models", "planner"),
    "executor": ("cost_models", "planner", "executor"),
}
PURE = ("cost_models.records", "cost_models.cost")   # no torch, no probe, however deep the imports go


def _modules() -> dict[str, Path]:
    out = {"cli": ROOT / "cli.py"}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module `name` imports, anywhere in the file (inside functions too), as dotted names: the project's
    modules resolved to the module (not the object) imported, others as written."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return out


def _graph(modules: dict[str, Path] | None = None) -> nx.DiGraph:
    modules = _modules() if modules is None else modules
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name, external=set())
        for target in _imported(name, path, modules):
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]
            if target in modules:
                if target != name:
                    graph.add_edge(name, target)
            else:
                graph.nodes[name]["external"].add(target)
    return graph


def _room(module: str) -> str | None:
    return max((r for r in ROOMS if module == r or module.startswith(r + ".")), key=len, default=None)


def test_no_import_cycles():
    cycles = list(nx.simple_cycles(_graph()))
    assert not cycles, "import cycles (function-level imports count):\n" + "\n".join(" -> ".join(c) for c in cycles)


def _wrong_way(graph: nx.DiGraph) -> list[str]:
    wrong = []
    for src, dst in graph.edges:
        room = _room(src)
        if room and dst != "cost_models" and not any(dst == r or dst.startswith(r + ".") for r in ROOMS[room]):
            wrong.append(f"{src} imports {dst}")
    return sorted(wrong)


def test_imports_run_one_way():
    wrong = _wrong_way(_graph())
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_pure_cost_code_reaches_neither_torch_nor_a_probe():
    graph = _graph()
    for module in (m for m in graph if _room(m) in PURE):
        reached = {module} | nx.descendants(graph, module)
        torch = sorted(m for m in reached if any(e.split(".")[0] == "torch" for e in graph.nodes[m]["external"]))
        assert not torch, f"{module} reaches torch through {torch}"
        assert all(_room(m) in PURE for m in reached), (
            f"{module} reaches {sorted(m for m in reached if _room(m) not in PURE)}")


def test_every_product_module_sits_in_a_room():
    assert not [m for m in _modules() if m not in ("cli", "cost_models") and _room(m) is None]


def test_the_checks_see_a_cycle_and_a_wrong_way_import(tmp_path):
    """The graph reader on a planted package: a function-level import closing a cycle, and a relative import."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    modules = {"pkg": pkg / "__init__.py", "pkg.a": pkg / "a.py", "pkg.b": pkg / "b.py"}
    assert _imported("pkg.a", modules["pkg.a"], modules) == {"pkg.b"}
    assert _imported("pkg.b", modules["pkg.b"], modules) == {"pkg.a"}
    assert [sorted(c) for c in nx.simple_cycles(_graph(modules))] == [["pkg.a", "pkg.b"]]
    # a records module importing the cost room, and a cost module importing a probe, against the layering
    low = tmp_path / "low.py"
    low.write_text("from cost_models.cost import estimate\nfrom cost_models.records import base\n")
    high = tmp_path / "high.py"
    high.write_text("from cost_models.profiling import cluster_probe\n")
    planted = {**_modules(), "cost_models.records.planted": low, "cost_models.cost.planted": high}
    assert [w for w in _wrong_way(_graph(planted)) if "planted" in w] == [
        "cost_models.cost.planted imports cost_models.profiling.cluster_probe",
        "cost_models.records.planted imports cost_models.cost.estimate"]


def test_each_room_says_what_every_module_in_it_is_for():
    """A room's docstring names each of its modules, so a reader of the package doc finds every file's job."""
    for room in (r for r in ROOMS if r.startswith("cost_models.")):
        folder = ROOT / room.replace(".", "/")
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text(encoding="utf-8"))) or ""
        unnamed = [p.stem for p in folder.glob("*.py") if p.stem != "__init__" and p.stem not in doc]
        assert not unnamed, f"{room}'s docstring does not say what {unnamed} hold"
