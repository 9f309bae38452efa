"""The house's rules, on both distributions: no module reaches into another's private names, and
no import circle, deferred imports and those for type checking included, so that each layer reads
before the ones above it."""

import ast
import pathlib

import pytest

import devipc
import devipc_openreg

PACKAGES = {
    "devipc": pathlib.Path(devipc.__file__).parent,
    "devipc_openreg": pathlib.Path(devipc_openreg.__file__).parent,
}


class Package:
    """One distribution's modules, by dotted name, read from their sources."""

    def __init__(self, name: str):
        self.name, self.root = name, PACKAGES[name]
        self.paths = {self.module_of(path): path for path in sorted(self.root.rglob("*.py"))}

    def module_of(self, path: pathlib.Path) -> str:
        parts = (self.name, *path.relative_to(self.root).with_suffix("").parts)
        return ".".join(parts).removesuffix(".__init__")

    def source_of(self, module: str, node: ast.ImportFrom) -> str:
        """The module an import names, resolved against `module`."""
        if not node.level:
            return node.module or ""
        package = module.split(".")
        if self.paths[module].name != "__init__.py":
            package = package[:-1]
        base = package[: len(package) - node.level + 1]
        return ".".join(base + ([node.module] if node.module else []))

    def imports(self, module: str) -> set[str]:
        """The modules of this package that `module` imports, anywhere in its source."""
        found = set()
        for node in ast.walk(ast.parse(self.paths[module].read_text())):
            if isinstance(node, ast.ImportFrom):
                source = self.source_of(module, node)
                for alias in node.names:
                    name = f"{source}.{alias.name}"
                    found.add(name if name in self.paths else source)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        return {name for name in found if name in self.paths and name != module}

    def private_reaches(self, module: str) -> list[str]:
        """Names with a leading underscore (dunders aside) that `module` takes from another
        module of the package: imported from it, or read as an attribute of it."""
        found, aliases = [], {}
        tree = ast.parse(self.paths[module].read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                source = self.source_of(module, node)
                for alias in node.names:
                    if f"{source}.{alias.name}" in self.paths:
                        aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
                    elif _private(alias.name):
                        found.append(f"from {source} import {alias.name}")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and _private(node.attr)
                and f"{aliases[node.value.id]}.{node.attr}" not in self.paths
            ):
                found.append(f"{aliases[node.value.id]}.{node.attr}")
        return found


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_no_import_circle(name):
    package = Package(name)
    graph = {module: package.imports(module) for module in package.paths}
    assert circles(graph) == []


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_no_module_reaches_into_another_modules_private_names(name):
    """Layers talk through each other's named functions, never their private state."""
    package = Package(name)
    reaches = {module: package.private_reaches(module) for module in package.paths}
    assert {module: found for module, found in reaches.items() if found} == {}


# The layers of devipc, bottom to top, and the parts of the package each may import (besides
# itself). A part is a folder (`devipc._core`) or a top-level module (`devipc.hooks`); the package
# itself is "devipc". A part missing here fails the test: a new folder says where it stands.
LAYERS = {
    "_public": set(),
    "_core": set(),
    "hooks": {"_core", "_public"},
    "rfc": {"_core", "_public"},
    "p2p": {"_core", "_public"},
    "_weights": {"_core", "p2p"},
    "devipc": {"_core", "_weights", "_public", "hooks", "rfc"},
    "ray": {"_core", "_weights", "p2p", "_public"},
    "vllm": {"_core", "_weights", "_public"},
    "conformance": {"devipc", "hooks", "p2p"},
    "_tools": {"_core", "_weights", "p2p", "devipc", "hooks", "_public"},
    "__main__": {"_tools"},
}
FOLDERS = sorted(part for part in LAYERS if (PACKAGES["devipc"] / part).is_dir())


def part_of(module: str) -> str:
    """`devipc._core._wire` -> `_core`; `devipc` -> `devipc`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_the_folders_are_the_layers():
    """No private module lies loose in the package: each is in the folder of its layer."""
    loose = sorted(
        path.name
        for path in PACKAGES["devipc"].glob("_*.py")
        if path.stem not in ("__init__", "__main__", "_public")
    )
    assert loose == []
    package = Package("devipc")
    assert {part_of(module) for module in package.paths} == set(LAYERS)


def test_each_layer_imports_only_the_layers_it_names():
    package = Package("devipc")
    upward = sorted(
        f"{module} -> {other}"
        for module in package.paths
        for other in package.imports(module)
        if part_of(other) != part_of(module) and part_of(other) not in LAYERS[part_of(module)]
    )
    assert upward == []


def test_the_layer_rules_have_no_circle():
    assert circles({part: set(allowed) for part, allowed in LAYERS.items()}) == []


@pytest.mark.parametrize("folder", FOLDERS)
def test_each_folder_says_what_it_owns_and_what_it_may_import(folder):
    docstring = (
        ast.get_docstring(ast.parse((PACKAGES["devipc"] / folder / "__init__.py").read_text()))
        or ""
    )
    named = {part for part in LAYERS[folder] - {"_public"} if f"`{part}`" in docstring}
    assert len(docstring) > 200 and named == LAYERS[folder] - {"_public"}
