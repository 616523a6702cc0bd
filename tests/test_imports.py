"""The package's import graph has no cycles, function-level imports included: each module's dependencies sit below
it."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# docs/architecture.md's "Import layers", top to bottom: a package may import from its own layer and those below.
# Every layer is a set of whole packages (folders of project/).
LAYERS = [
    ("entry points", ["project.cli"]),
    ("launch", ["project.launch"]),
    ("plan", ["project.plan"]),
    ("config", ["project.config"]),
    ("Lightning parts", ["project.tasks", "project.observability", "project.strategies"]),
    ("layouts", ["project.layouts"]),
    ("model options", ["project.model_options"]),
    ("job", ["project.job"]),
    ("parallelism", ["project.parallel", "project.accounting"]),
    ("checkpoints", ["project.checkpointing"]),
    ("plain PyTorch", ["project.models", "project.data"]),
    ("options", ["project.options"]),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def type_checking_imports(tree: ast.Module) -> set[ast.AST]:
    """The imports under ``if TYPE_CHECKING:``, which only a type checker runs: a type both modules name."""
    blocks = [node for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)]
    return {inner for block in blocks for statement in block.body for inner in ast.walk(statement)}


def import_graph(type_checking: bool = True) -> dict[str, set[str]]:
    """Each module of ``project`` -> the modules of ``project`` it imports anywhere in its file (and under ``if
    TYPE_CHECKING:`` unless ``type_checking`` is false)."""
    modules = {module_name(path): path for path in (REPO / "project").rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skipped = set() if type_checking else type_checking_imports(tree)
        for node in ast.walk(tree):
            if node in skipped:
                continue
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
    """Of the imports that run: a type named both ways under ``if TYPE_CHECKING:`` (a job and its layout) is none."""
    graph = import_graph(type_checking=False)
    assert len(graph) > 50 and graph["project.launch.launcher"], "the graph must see the package's imports"
    assert cycles(graph) == []


def layer_of(module: str) -> int:
    """The index in ``LAYERS`` (0 the top) of the package that holds ``module``."""
    package = ".".join(module.split(".")[:2])
    matches = [index for index, (_, packages) in enumerate(LAYERS) if package in packages]
    assert matches, f"{package} is in no layer of LAYERS (and of docs/architecture.md)"
    return matches[0]


def test_every_layer_is_whole_packages():
    """The table names packages (folders of ``project/``) only, each once, and every package is in it."""
    listed = [package for _, packages in LAYERS for package in packages]
    folders = {f"project.{path.parent.name}" for path in (REPO / "project").glob("*/__init__.py")}
    assert sorted(listed) == sorted(folders) and len(set(listed)) == len(listed)


def test_no_import_climbs_a_layer():
    graph = import_graph()
    climbs = [
        f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
        for module, targets in graph.items()
        if module != "project"  # the root package holds no code
        for target in targets
        if target != "project" and layer_of(target) < layer_of(module)
    ]
    assert climbs == []


def test_the_layer_check_sees_a_climb():
    assert (
        layer_of("project.models.gpt")
        > layer_of("project.parallel.tensor_parallel_plans")
        > layer_of("project.launch.worker")
    )


def test_no_two_modules_share_a_name():
    """A module's name alone says which one it is (no two ``tensor_parallel.py`` in different folders)."""
    names = [path.name for path in (REPO / "project").rglob("*.py") if path.name != "__init__.py"]
    assert len(names) > 50 and sorted({name for name in names if names.count(name) > 1}) == []
