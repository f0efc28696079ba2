"""dpkit's layers (DESIGN.md): data flows down, no module imports a layer above its own."""

import ast
from pathlib import Path

import dpkit

PACKAGE = Path(dpkit.__file__).parent

# from the top down; a module may import its own layer and any below it. checkpoint, precision, launch,
# examples and errors are leaves every layer may use. plan/ predicts from what observe/ and bench measured
# (and may name the strategies); nothing below the CLI runs it. observe/ listens to parallel/'s seam.
LAYERS = [
    ("cli", ["dpkit.cli"]),
    ("plan", ["dpkit.plan"]),
    ("engine", ["dpkit.training.engine"]),
    ("strategies", ["dpkit.strategies"]),
    ("observe", ["dpkit.observe"]),
    ("parallel", ["dpkit.parallel"]),
    ("devices", ["dpkit.devices"]),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, package: str) -> set[str]:
    """Every dpkit module a file of `package` imports (absolute or relative), at any place in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "dpkit" or name.startswith("dpkit.")}


def layer_of(module: str) -> int | None:
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return None


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        graph[name] = imports_of(path, name if path.name == "__init__.py" else name.rpartition(".")[0])
    return graph


def test_parallel_knows_nothing_of_observe_strategies_engine_or_cli():
    for module, imported in import_graph().items():
        if module.startswith("dpkit.parallel"):
            above = {name for name in imported
                     if name.split(".")[:2] in (["dpkit", "observe"], ["dpkit", "strategies"], ["dpkit", "engine"], ["dpkit", "cli"])}
            assert not above, f"{module} imports {sorted(above)}"


def test_no_layer_imports_a_layer_above_it():
    offences = []
    for module, imported in import_graph().items():
        mine = layer_of(module)
        if mine is None:
            continue
        for name in imported:
            theirs = layer_of(name)
            if theirs is not None and theirs < mine:
                offences.append(f"{module} ({LAYERS[mine][0]}) imports {name} ({LAYERS[theirs][0]})")
    assert not offences, "\n".join(offences)


def test_the_check_sees_relative_and_function_level_imports(tmp_path):
    offending = tmp_path / "offending.py"
    offending.write_text("from ..observe import observer\nfrom . import hooks\n\ndef f():\n    import dpkit.training.engine\n")
    imported = imports_of(offending, "dpkit.parallel")
    assert {"dpkit.observe", "dpkit.observe.observer", "dpkit.parallel.hooks", "dpkit.training.engine"} <= imported
    assert {layer_of(name) for name in imported} == {layer_of("dpkit.observe"), layer_of("dpkit.parallel"), layer_of("dpkit.training.engine")}
