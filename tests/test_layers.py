"""The package's layers (docs/design.md, "Layers"): no module imports one of a layer above it.

Read from the source with ``ast`` (every ``import`` and ``from ... import``, also inside functions):
a lower layer never calls back up, whatever the import's position.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Bottom to top. A module's layer is the longest prefix listed; a top-level module of dispatch_io not
# listed is taken for an entry point (the top layer: nothing may import it).
LAYERS = {
    "dispatch_io.workers": 0, "dispatch_io.errors": 0, "dispatch_io.jax_compat": 0, "dispatch_io.tree": 0, "dispatch_io.collector": 0,
    "dispatch_io.locks": 0, "dispatch_io.progress": 0,
    "dispatch_io.storage": 1, "dispatch_io.validate": 1,
    "dispatch_io.plan": 2,                                  # the save plan, pure
    "dispatch_io.manifest": 3,
    "dispatch_io.save": 4, "dispatch_io.read": 4,           # running a save; reading back
    "dispatch_io.incremental": 5,
    "dispatch_io.formats": 6, "dispatch_io.multihost": 6,
    "dispatch_io.dispatcher": 7, "dispatch_io.read_api": 7, "dispatch_io.colocated": 7, "dispatch_io.sharding": 7,
    "dispatch_io.options": 7, "dispatch_io.runner": 7,
    "dispatch_io.manager": 8, "dispatch_io.manager.step_policies": 8,
    "dispatch_io.manager.tiers": 9,
    "dispatch_io.manager.manager": 10, "dispatch_io.manager.reads": 10,
    "dispatch_io": 11, "dispatch_io.cli": 11, "dispatch_io.policies": 11,
}
# Subpackages of one layer that must not import each other.
APART = [("dispatch_io.formats", "dispatch_io.multihost"), ("dispatch_io.save", "dispatch_io.read"),
         ("dispatch_io.storage", "dispatch_io.validate")]
PACKAGE_FRONTS = {"dispatch_io", "dispatch_io.manager", "dispatch_io.manager.tiers"}  # __init__: re-exports


def _layer(module: str) -> tuple[int, str]:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in LAYERS:
            return LAYERS[prefix], prefix
    raise AssertionError(f"{module} is in no layer")


def _modules():
    for package, folder in (("dispatch_io", "dispatch_io"), ("dispatch_io.workers", "workers")):  # installed as
        for path in sorted((ROOT / folder).rglob("*.py")):                                          # package-dir maps it
            parts = package.split(".") + list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join(parts), path


def _imports(path: pathlib.Path, module: str):
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:  # "from pkg import submodule" names the submodule
                yield f"{base}.{alias.name}"


MODULES = dict(_modules())


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_goes_up(module):
    if module in PACKAGE_FRONTS:
        return
    mine, my_prefix = _layer(module)
    wrong = []
    for name in _imports(MODULES[module], module):
        if not name.startswith("dispatch_io"):
            continue
        while name not in MODULES and "." in name:  # "pkg.mod.attr" -> "pkg.mod"
            name = name.rpartition(".")[0]
        if name not in MODULES or name in PACKAGE_FRONTS and name != "dispatch_io.manager.tiers":
            continue
        theirs, their_prefix = _layer(name)
        if theirs > mine or (theirs == mine and (my_prefix, their_prefix) in APART + [t[::-1] for t in APART]):
            wrong.append(name)
    assert not wrong, f"{module} (layer {mine}) imports from above or beside it: {wrong}"


def test_the_top_level_holds_at_most_twenty_modules():
    """The core lives in packages named by concern; the top holds the entry points and the few modules every layer uses."""
    top = sorted(p.name for p in (ROOT / "dispatch_io").glob("*.py"))
    assert len(top) <= 20, f"{len(top)} modules at the top of dispatch_io/: {top}"


def test_every_module_has_a_layer_and_packages_say_what_they_own():
    for module, path in MODULES.items():
        _layer(module)
        if path.name == "__init__.py":
            assert ast.get_docstring(ast.parse(path.read_text())), f"{module} has no docstring saying what it owns"
