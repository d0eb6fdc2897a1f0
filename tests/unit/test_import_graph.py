"""The package's own import graph (nodes/, training/; every relative import, also those inside functions): no
cycles, and the layers nodes -> nodes/bridge -> training: training/ never imports nodes/ (the engine is pure), the
bridge never imports a node module (docs/ARCHITECTURE.md). Read from the source with
ast, so no ComfyUI is needed."""
import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("nodes", "training")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _exists(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def import_graph() -> dict[str, set[str]]:
    """{module: the package's modules it imports} for every module of nodes/ and training/."""
    graph = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            name = _module_name(path)
            is_package = path.name == "__init__.py"
            base = name.split(".") if is_package else name.split(".")[:-1]
            edges = set()
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.ImportFrom) or node.level == 0:
                    continue
                anchor = base[: len(base) - (node.level - 1)]
                target = ".".join(anchor + (node.module.split(".") if node.module else []))
                # `from . import x`: x is a module when one of that name exists
                for alias in node.names:
                    sub = f"{target}.{alias.name}" if target else alias.name
                    edges.add(sub if _exists(sub) else target)
            graph[name] = {edge for edge in edges if edge and edge != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        stack.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_no_import_cycle():
    graph = import_graph()
    assert {"nodes.bridge.comfy_bridge", "nodes.bridge.planning", "nodes.bridge.comfy_model", "nodes.bridge.families"} <= set(graph)
    assert "nodes.bridge.planning" in graph["nodes.bridge.comfy_bridge"]  # resolved, not skipped
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_training_never_imports_nodes():
    wrong = {module: sorted(t for t in targets if t.startswith("nodes"))
             for module, targets in import_graph().items() if module.startswith("training")}
    assert {module: targets for module, targets in wrong.items() if targets} == {}


def test_bridge_never_imports_node_modules():
    """nodes/bridge/ (ComfyUI's objects for the engine) imports only itself and training/; the node modules of nodes/
    (schemas and execute, with io_types / inputs) sit above it."""
    graph = import_graph()
    assert {"nodes.bridge.validation", "nodes.bridge.model_files", "nodes.train_lora"} <= set(graph)
    assert "nodes.bridge.validation" in graph["nodes.train_lora"]
    wrong = {module: sorted(t for t in targets if t.startswith("nodes") and not t.startswith("nodes.bridge"))
             for module, targets in graph.items() if module.startswith("nodes.bridge")}
    assert {module: targets for module, targets in wrong.items() if targets} == {}


def test_node_modules_hold_only_nodes_and_their_inputs():
    """A module directly in nodes/ declares node classes (NODES) or is one of the two schema helpers (io_types,
    inputs); everything else lives in nodes/bridge/."""
    schema_helpers = {"io_types.py", "inputs.py", "__init__.py"}
    without_nodes = [path.name for path in sorted((REPO / "nodes").glob("*.py"))
                     if path.name not in schema_helpers and "\nNODES = [" not in path.read_text()]
    assert without_nodes == []


def _module_level(tree: ast.AST):
    """The nodes of a module outside function bodies (what runs when it is imported)."""
    for node in ast.iter_child_nodes(tree):
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _module_level(node)


def test_training_imports_without_comfyui():
    """No import of ComfyUI's modules when a training/ module is imported. (Kind oft builds on ComfyUI's OFT class,
    imported inside the function that needs it: training/core/adapters.py `_oft_block_class`.)"""
    comfyui = ("comfy", "comfy_extras", "comfy_api", "comfy_execution", "folder_paths", "nodes", "server", "execution")
    wrong = []
    for path in sorted((REPO / "training").rglob("*.py")):
        for node in _module_level(ast.parse(path.read_text(), str(path))):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else
                     [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
            wrong += [f"{path.relative_to(REPO)}: {name}" for name in names if name.split(".")[0] in comfyui]
    assert wrong == []


def test_training_layers():
    """training/: data/ imports neither memory/ nor core/; memory/ does not import core/ (docs/ARCHITECTURE.md)."""
    graph = import_graph()
    assert {"training.data.cache_store", "training.memory.policy", "training.core.trainer"} <= set(graph)
    above = {"training.data": ("training.memory", "training.core"), "training.memory": ("training.core",)}
    wrong = {module: sorted(t for t in targets if t.startswith(above[layer]))
             for module, targets in graph.items() for layer in above if module.startswith(layer)}
    assert {module: targets for module, targets in wrong.items() if targets} == {}


def test_a_cycle_is_found():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
