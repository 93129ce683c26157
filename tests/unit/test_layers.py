"""The package's layers, read from its source: every import flows down (commands ->
calibrate -> selector -> train -> monitor -> the bottom), no two modules import each
other through any path, no import hides inside a function, and no private name is
imported from another module."""

import ast
from pathlib import Path

PACKAGE = Path(__import__("mgpu").__file__).parent
# The bottom (0) up to the package's face (6): a module may import only its own layer or below.
LAYERS = {
    "_runtime": 0,
    "errors": 0,
    "atomic": 0,
    "console": 0,
    "hostinfo": 0,
    "npzfile": 0,
    "_core": 0,
    "_core_emu": 0,
    "monitor": 1,
    "train": 2,
    "selector": 3,
    "calibrate": 4,
    "commands": 5,
}
FACE = 6  # __init__, __main__ and the documented old paths (perf, gemm_fit, allreduce_fit)


def modules() -> dict:
    """Dotted name under mgpu -> path, for every module of the package."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if "peers" in parts:  # scripts run in another framework's interpreter, never imported
            continue
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def layer(module: str) -> int:
    return LAYERS.get(module.split(".")[0], FACE) if module else FACE


def imports(name: str, path: Path, known: dict):
    """(target module, imported name, line, inside a function) for each import of mgpu's own modules."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    tree = ast.parse(path.read_text())
    in_function = {
        id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(f)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "mgpu"):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + (node.module.split(".") if node.module else []))
            module = module[len("mgpu.") :] if module.startswith("mgpu.") else "" if module == "mgpu" else module
            for alias in node.names:
                sub = f"{module}.{alias.name}" if module else alias.name
                target = sub if sub in known or alias.name in ("_core", "_core_emu") else module
                yield target, alias.name, node.lineno, id(node) in in_function


def test_imports_flow_down_the_layers():
    known = modules()
    upward = [
        f"{name} -> {target} (line {line})"
        for name, path in known.items()
        for target, _, line, _ in imports(name, path, known)
        if layer(target) > layer(name)
    ]
    assert not upward


def test_no_import_circles():
    known = modules()
    graph = {
        name: {t for t, *_ in imports(name, path, known) if t in known and t != name} for name, path in known.items()
    }
    state, circles = {}, []

    def visit(node, trail):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(" -> ".join(trail[trail.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not circles


def test_no_import_inside_a_function_and_no_private_name_across_modules():
    known = modules()
    found = [
        f"{name}:{line} {what}"
        for name, path in known.items()
        for target, what, line, inside in imports(name, path, known)
        if inside or (what.startswith("_") and what not in ("_core", "_core_emu", "__version__"))
    ]
    assert not found


def test_command_modules_never_import_the_command_line():
    """commands/main.py imports the command modules; nothing imports it but python -m mgpu."""
    known = modules()
    offenders = [
        f"{name}:{line}"
        for name, path in known.items()
        if name not in ("__main__", "commands.main")
        for target, _, line, _ in imports(name, path, known)
        if target == "commands.main"
    ]
    assert not offenders
