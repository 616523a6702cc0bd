"""The package's import graph has no cycles, function-level imports included: each module's dependencies sit below
it."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# docs/architecture.md's "Import layers", top to bottom: a module may import from its own layer and those below.
# A module belongs to the layer of the longest prefix that names it.
LAYERS = [
    ("entry points", ["project.cli"]),
    ("job", ["project.launch", "project.config.job"]),
    ("plan", ["project.memory.plan", "project.memory.step_time", "project.memory.depth", "project.memory.search"]),
    (
        "Lightning parts",
        ["project.tasks", "project.observability", "project.memory.measure", "project.checkpointing.latest_and_best"],
    ),
    ("parallelism", ["project.distributed"]),
    (
        "foundations",
        [
            "project.config.checks",
            "project.config.schema",
            "project.config.build",
            "project.memory.simulation",
            "project.memory.counts",
            "project.checkpointing.files",
            "project.checkpointing.hf",
            "project.distributed.dims",
        ],
    ),
    ("plain PyTorch", ["project.models", "project.data", "project.tasks.decoding", "project.config.resolvers"]),
    ("errors", ["project.config.errors", "project.config.overrides", "project.config.option_types"]),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each module of ``project`` -> the modules of ``project`` it imports anywhere in its file."""
    modules = {module_name(path): path for path in (REPO / "project").rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # ``from package import module`` imports the submodule; ``from module import name`` the module.
                targets = [
                    f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                    for alias in node.names
                ]
            else:
                continue
            for target in targets:
                # Importing a.b.c runs a/__init__.py and a/b/__init__.py first, unless the importer is inside them.
                parts = target.split(".")
                ancestors = [".".join(parts[:end]) for end in range(2, len(parts))]
                graph[name] |= {
                    module
                    for module in [*ancestors, target]
                    if module in modules and module != name and not name.startswith(module + ".")
                }
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for successor in graph[node]:
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_project_has_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50 and graph["project.launch.launcher"], "the graph must see the package's imports"
    assert cycles(graph) == []


def layer_of(module: str) -> int:
    """The index in ``LAYERS`` (0 the top) of the longest prefix naming ``module``."""
    matches = [
        (len(prefix), index)
        for index, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert matches, f"{module} is in no layer of LAYERS (and of docs/architecture.md)"
    return max(matches)[1]


def test_no_import_climbs_a_layer():
    graph = import_graph()
    packages = {name for name in graph if (REPO / name.replace(".", "/") / "__init__.py").is_file()}
    climbs = [
        f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
        for module, targets in graph.items()
        if module not in packages  # a package only gathers its modules
        for target in targets
        if target not in packages and layer_of(target) < layer_of(module)
    ]
    assert climbs == []


def test_the_layer_check_sees_a_climb():
    assert layer_of("project.models.gpt") > layer_of("project.distributed.plans") > layer_of("project.launch.worker")


def test_no_two_modules_share_a_name():
    """A module's name alone says which one it is (no two ``tensor_parallel.py`` in different folders)."""
    names = [path.name for path in (REPO / "project").rglob("*.py") if path.name != "__init__.py"]
    assert len(names) > 50 and sorted({name for name in names if names.count(name) > 1}) == []
