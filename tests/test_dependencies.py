"""The dependency rule the README states: every import of every module of the package (at the top, inside
functions, under TYPE_CHECKING alike) points down this order or stays in its own level, and no module
imports one that imports it back. The one exception is a module's ``if __name__ == "__main__":`` block,
the glue that lets a top-level module run as a script in a checkout (nothing imports it).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"gdn2": "gdn2", "configs": "gdn2.configs", "data_prep": "gdn2.data_prep", "eval": "gdn2.eval"}

# Lowest first; a module may import modules of its own level or of a level before it. A name ending in
# ".*" stands for a package and all of its modules.
LEVELS = [
    ["gdn2", "gdn2.files", "gdn2.commandline", "gdn2.config", "gdn2.configs", "gdn2.tokenizer", "gdn2.data",
     "gdn2.data.shards"],
    ["gdn2.ops.*"],
    ["gdn2.stages", "gdn2.float8", "gdn2.linear", "gdn2.modules", "gdn2.loss", "gdn2.recompute", "gdn2.layout"],
    ["gdn2.layers.*"],
    ["gdn2.model"],
    ["gdn2.options", "gdn2.generation.*", "gdn2.checkpoint.*", "gdn2.data.loader"],
    ["gdn2.eval.*", "gdn2.hf.*", "gdn2.data_prep.*"],
    ["gdn2.train.*"],
    ["gdn2.study", "gdn2.mqar"],
    ["gdn2.__main__"],
]


def package_modules(folders: dict[str, str] = FOLDERS, root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file, for every Python file installed in the package."""
    modules = {}
    for folder, package in folders.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def level_of(module: str, levels: list[list[str]] = LEVELS) -> int:
    """The level a module belongs to (the most specific entry that names it)."""
    best, found = -1, None
    for index, entries in enumerate(levels):
        for entry in entries:
            prefix = entry[:-2] if entry.endswith(".*") else entry
            matches = module == prefix or (entry.endswith(".*") and module.startswith(prefix + "."))
            if matches and len(prefix) > best:
                best, found = len(prefix), index
    if found is None:
        raise AssertionError(f"{module} has no level in the dependency order: place it in LEVELS and the README")
    return found


def _script_entry(node: ast.stmt) -> bool:
    test = getattr(node, "test", None)
    return (isinstance(node, ast.If) and isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
            and test.left.id == "__name__")


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``module`` imports anywhere in its file (``from a import b`` counts as
    ``a.b`` when that is a module, else ``a``)."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for top in tree.body:
        if _script_entry(top):
            continue
        for node in ast.walk(top):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in known and "." in name:
                    name = name.rpartition(".")[0]
                if name in known and name != module:
                    found.add(name)
    return found


def violations(folders: dict[str, str] = FOLDERS, root: Path = ROOT, levels: list[list[str]] = LEVELS) -> list[str]:
    """Every import that points up the order, and every cycle, as sentences."""
    modules = package_modules(folders, root)
    graph = {m: imports_of(m, p, set(modules)) for m, p in modules.items()}
    problems = [f"{m} (level {level_of(m, levels)}) imports {d} (level {level_of(d, levels)})"
                for m, deps in sorted(graph.items()) for d in sorted(deps) if level_of(d, levels) > level_of(m, levels)]
    # cycles: a depth-first search over the whole graph
    state: dict[str, int] = {}

    def visit(m: str, trail: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                problems.append("import cycle: " + " -> ".join(trail[trail.index(d):] + [m, d]) if d in trail
                                else f"import cycle: {m} -> {d}")
            elif d not in state:
                visit(d, trail + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    return problems


def test_every_import_points_down_the_stated_order_and_none_comes_back():
    assert violations() == []


def test_the_check_fails_on_a_reversed_import_and_on_a_cycle(tmp_path):
    """An operator that imports the model, and two building blocks importing each other, are both found."""
    pkg = tmp_path / "gdn2"
    (pkg / "ops").mkdir(parents=True)
    for name, text in {"__init__.py": "", "model.py": "import gdn2.stages\n", "stages.py": "from gdn2 import loss\n",
                       "loss.py": "def f():\n    from gdn2.stages import g\n", "ops/__init__.py": "",
                       "ops/api.py": "from gdn2.model import GPT\n"}.items():
        (pkg / name).write_text(text)
    found = violations({"gdn2": "gdn2"}, tmp_path)
    assert "gdn2.ops.api (level 1) imports gdn2.model (level 4)" in found
    assert any(p.startswith("import cycle:") and "gdn2.stages" in p and "gdn2.loss" in p for p in found)


def test_the_readme_states_this_order():
    """The README's architecture section spells the same levels, lowest first."""
    text = (ROOT / "README.md").read_text()
    start = text.index("Dependencies point one way")
    stated = text[start: text.index("\n\n", start)]
    positions = []
    for entries in LEVELS:
        shown = [entry.removeprefix("gdn2.").removesuffix(".*") for entry in entries if entry != "gdn2"]
        assert all(f"`{name}`" in stated for name in shown), (shown, stated)
        positions.append(min(stated.index(f"`{name}`") for name in shown))
    assert positions == sorted(positions)
