"""The house's rules, on both distributions: no module reaches into another's private names, and
no import circle, deferred imports and those for type checking included, so that each layer reads
before the ones above it."""
import ast
import pathlib

import pytest

import devipc
import devipc_openreg

PACKAGES = {"devipc": pathlib.Path(devipc.__file__).parent,
            "devipc_openreg": pathlib.Path(devipc_openreg.__file__).parent}


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
        base = package[:len(package) - node.level + 1]
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
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in aliases and _private(node.attr) \
                    and f"{aliases[node.value.id]}.{node.attr}" not in self.paths:
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
