"""The shape of the product code, read from its syntax trees: short functions, and torch's private names in one
module (cost_models/torch_compat/torch_private.py)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cost_models", "planner", "executor")
PRIVATE_HOME = Path("cost_models/torch_compat/torch_private.py")
MAX_FUNCTION_LINES = 60


def _product_files() -> list[Path]:
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))] + [ROOT / "cli.py"]
    return [p.relative_to(ROOT) for p in files]


def _tree(path: Path) -> ast.Module:
    return ast.parse((ROOT / path).read_text(encoding="utf-8"), filename=str(path))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_names(trees: dict[Path, ast.Module]) -> set[str]:
    """The project's classes and modules: `Record._hints_cache` or `model_profiler._x` is not a library's."""
    names = set(PACKAGES) | {p.stem for p in trees}
    for tree in trees.values():
        names |= {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    return names


def _own_modules_imported(tree: ast.Module) -> set[str]:
    """Names this file binds to the project's modules (`from executor import checkpoint_layout as layout`)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES + ("cli",):
            out |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] in PACKAGES}
    return out


def _library_private_uses(tree: ast.Module, own: set[str]) -> list[tuple[int, str]]:
    """(line, what) for every private name of a library: imported from a private module or by a private name,
    read as an attribute of anything but self, cls or the project's own classes and modules, or named to getattr."""
    own = own | _own_modules_imported(tree) | {"self", "cls"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names
                      if any(_private(part) for part in a.name.split("."))]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] not in PACKAGES:
            if any(_private(part) for part in node.module.split(".")) or any(_private(a.name) for a in node.names):
                found.append((node.lineno, f"from {node.module} import {', '.join(a.name for a in node.names)}"))
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            if not (isinstance(base, ast.Name) and base.id in own):
                found.append((node.lineno, f"{ast.unparse(base)}.{node.attr}"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value)):
            base = node.args[0]
            if not (isinstance(base, ast.Name) and base.id in own):
                found.append((node.lineno, f"{node.func.id}({ast.unparse(base)}, {node.args[1].value!r})"))
    return found


def test_torch_private_names_are_used_only_in_torch_private():
    trees = {p: _tree(p) for p in _product_files()}
    own = _own_names(trees)
    uses = [f"{path}:{line}: {what}" for path, tree in trees.items() if path != PRIVATE_HOME
            for line, what in sorted(set(_library_private_uses(tree, own)))]
    assert not uses, ("private names of torch (or another library) outside cost_models/torch_compat/torch_private.py; "
                      "wrap them there with why and the torch version checked:\n" + "\n".join(uses))


def test_the_private_name_check_sees_each_form():
    tree = ast.parse("import torch.utils._pytree\nfrom torch.utils._pytree import tree_map\n"
                     "from torch.distributed.distributed_c10d import _get_default_group\n"
                     "x = mod._buffers\ny = getattr(s, '_stages', None)\nz = self._mine\n")
    assert sorted(line for line, _ in _library_private_uses(tree, set())) == [1, 2, 3, 4, 5]


def _long_functions(path: Path, tree: ast.Module) -> list[str]:
    return [f"{path}:{node.name}:{node.end_lineno - node.lineno + 1}" for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_function_is_longer_than_60_lines():
    long = [entry for path in _product_files() for entry in _long_functions(path, _tree(path))]
    assert not long, f"functions longer than {MAX_FUNCTION_LINES} lines (file:function:lines, from `def` to the " \
                     f"last line), split them:\n" + "\n".join(long)


# environment variables users set (documented in the README and --help) and the launcher's own handshake; every
# other ZEROPIPE_ variable is a test hook and belongs in executor/testing_hooks.py
USER_ENV = {"ZEROPIPE_DEBUG", "ZEROPIPE_CHECKPOINT_KEY", "ZEROPIPE_STORE_FILE", "ZEROPIPE_START_METHOD"}
HOOKS_HOME = Path("executor/testing_hooks.py")


def _env_names(tree: ast.Module) -> set[str]:
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and n.value.startswith("ZEROPIPE_") and n.value.isupper()}


def _environ_reads(tree: ast.Module) -> set[str]:
    """Names read straight from the environment (os.environ[X], os.environ.get(X), os.getenv(X))."""
    def is_environ(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Subscript) and is_environ(n.value) and isinstance(n.slice, ast.Name):
            out.add(n.slice.id)
        elif (isinstance(n, ast.Call) and n.args and isinstance(n.args[0], ast.Name)
              and isinstance(n.func, ast.Attribute)
              and ((n.func.attr == "get" and is_environ(n.func.value)) or n.func.attr == "getenv")):
            out.add(n.args[0].id)
    return out


def test_test_hooks_are_named_in_one_module():
    stray = {f"{path}: {name}" for path in _product_files() if path != HOOKS_HOME
             for name in _env_names(_tree(path)) - USER_ENV}
    assert not stray, "test hooks outside executor/testing_hooks.py:\n" + "\n".join(sorted(stray))
    hook_names = {n.targets[0].id for n in _tree(HOOKS_HOME).body if isinstance(n, ast.Assign)
                  and isinstance(n.targets[0], ast.Name) and n.targets[0].id.endswith("_ENV")}
    direct = {f"{path}: {name}" for path in _product_files() if path != HOOKS_HOME
              for name in _environ_reads(_tree(path)) & hook_names}
    assert not direct, "test hooks read around testing_hooks.hook:\n" + "\n".join(sorted(direct))
    planted = ast.parse("a = os.environ.get(INIT_ENV, '')\nb = os.environ[DUMP_STATE_ENV]\nc = os.getenv(X)\n")
    assert _environ_reads(planted) == {"INIT_ENV", "DUMP_STATE_ENV", "X"}
    hooks = _env_names(_tree(HOOKS_HOME))
    assert {"ZEROPIPE_INJECT_FAILURE", "ZEROPIPE_DUMP_STATE", "ZEROPIPE_INIT"} <= hooks and not hooks & USER_ENV
