"""dpkit's layers: data flows down, no module imports a layer above its own, and every module has a layer.

From the top: the command, the tools that run models to measure them, the integrations with other
trainers, `dpkit train`'s recipe (its run, folder, metrics, model and data sources), the Engine (the loop API
and the resume transaction), the planner (which predicts from the strategies' traits and never runs a model),
the strategies, checkpoint and state files (which import no strategy), the launcher, measuring,
the one-process engine, devices. The leaves (argument checks, errors, precision, the built-in examples) may be
used by every layer and use no layer themselves. The package root only re-exports the public API.
"""

import ast
from pathlib import Path

import dpkit

PACKAGE = Path(dpkit.__file__).parent

LAYERS = [
    ("cli", ["dpkit.cli", "dpkit.__main__"]),
    ("tools", ["dpkit.tools"]),
    ("integrations", ["dpkit.integrations", "dpkit.lightning"]),
    ("recipe", ["dpkit.recipe"]),
    ("engine", ["dpkit.engine"]),
    ("plan", ["dpkit.plan"]),
    ("strategies", ["dpkit.strategies"]),
    ("checkpoint", ["dpkit.checkpoint"]),
    ("launch", ["dpkit.launch"]),
    ("observe", ["dpkit.observe"]),
    ("parallel", ["dpkit.parallel"]),
    ("devices", ["dpkit.devices"]),
]
LEAVES = ["dpkit.checks", "dpkit.errors", "dpkit.precision", "dpkit.examples", "dpkit.compilation"]
ROOT = "dpkit"


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


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> int | None:
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(_within(module, p) for p in prefixes):
            return rank
    return None


def is_leaf(module: str) -> bool:
    return any(_within(module, leaf) for leaf in LEAVES)


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        graph[name] = imports_of(path, name if path.name == "__init__.py" else name.rpartition(".")[0])
    return graph


def test_every_module_has_a_layer():
    homeless = sorted(
        module for module in import_graph() if module != ROOT and layer_of(module) is None and not is_leaf(module)
    )
    assert not homeless, f"modules in no layer (add them to LAYERS or LEAVES): {homeless}"


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
            if name == ROOT or (
                name.startswith(ROOT + ".") and name.count(".") == 1 and layer_of(name) is None and not is_leaf(name)
            ):
                offences.append(f"{module} imports {name}, the package root (import the module that defines it)")
    assert not offences, "\n".join(offences)


def test_the_leaves_use_no_layer():
    offences = [
        f"{module} imports {name}"
        for module, imported in import_graph().items()
        if is_leaf(module)
        for name in imported
        if not is_leaf(name)
    ]
    assert not offences, "\n".join(offences)


def test_parallel_knows_nothing_of_observe_strategies_engine_or_cli():
    for module, imported in import_graph().items():
        if _within(module, "dpkit.parallel"):
            above = {
                name for name in imported if layer_of(name) is not None and layer_of(name) < layer_of("dpkit.parallel")
            }
            assert not above, f"{module} imports {sorted(above)}"


def test_the_check_sees_relative_and_function_level_imports(tmp_path):
    offending = tmp_path / "offending.py"
    offending.write_text(
        "from ..observe import observer\nfrom . import hooks\n\ndef f():\n    import dpkit.engine.engine\n"
    )
    imported = imports_of(offending, "dpkit.parallel")
    assert {"dpkit.observe", "dpkit.observe.observer", "dpkit.parallel.hooks", "dpkit.engine.engine"} <= imported
    assert {layer_of(name) for name in imported} == {
        layer_of("dpkit.observe"),
        layer_of("dpkit.parallel"),
        layer_of("dpkit.engine"),
    }
