"""fastls' public surface: the kernels at the top level, the tuning hooks in fastls.tuning, each name once."""

import ast
import pathlib
import inspect
import subprocess
import sys
import typing


import pytest

import fastls
import fastls.tuning

PACKAGE = pathlib.Path(fastls.__file__).parent


def test_every_exported_name_resolves():
    for module in (fastls, fastls.tuning):
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert missing == [], f"{module.__name__} exports undefined names {missing}"
        assert len(set(module.__all__)) == len(module.__all__)


def test_each_public_name_has_one_home():
    assert set(fastls.__all__).isdisjoint(fastls.tuning.__all__)
    for name in fastls.tuning.__all__:
        assert not hasattr(fastls, name), f"fastls.{name} still aliases fastls.tuning.{name}"


def test_tuning_is_reachable_from_import_fastls_alone():
    out = subprocess.run([sys.executable, "-c", "import fastls; print(fastls.tuning.DEFAULT_SCRATCH_BYTES)"],
                         capture_output=True, text=True, check=True)
    assert int(out.stdout) == fastls.tuning.DEFAULT_SCRATCH_BYTES


def _public_callables():
    """Every public function and method fastls and fastls.tuning export, written in Python."""
    for module in (fastls, fastls.tuning):
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj):
                own = {key: value for cls in obj.__mro__ if cls.__module__.startswith("fastls")
                       for key, value in vars(cls).items()}
                for key, member in own.items():
                    member = getattr(member, "__func__", getattr(member, "fget", member))
                    if inspect.isfunction(member) and (not key.startswith("_") or key == "__init__"):
                        yield f"{name}.{key}", member
            elif inspect.isfunction(obj) or inspect.isfunction(getattr(obj, "__wrapped__", None)):
                yield name, obj


@pytest.mark.parametrize("name, function", list(_public_callables()), ids=lambda value: value
                         if isinstance(value, str) else "")
def test_public_functions_are_annotated(name, function):
    function = inspect.unwrap(function)
    hints = typing.get_type_hints(function)  # resolves: no name is misspelt or missing
    parameters = [p for p in inspect.signature(function).parameters if p not in ("self", "cls")]
    assert [p for p in parameters if p not in hints] == [], f"{name}: parameters without a type hint"
    assert "return" in hints, f"{name}: no return annotation"


def _imported_siblings(path):
    """The fastls modules ``path`` imports at module level (relative imports)."""
    siblings = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            siblings.update([node.module] if node.module else [alias.name for alias in node.names])
    return siblings


def test_the_modules_import_each_other_without_cycles():
    """Every module depends only on modules below it, so any of them can be imported first."""
    graph = {path.stem: _imported_siblings(path) for path in PACKAGE.glob("*.py") if path.stem != "__init__"}
    done, visiting = set(), []

    def visit(module):
        assert module not in visiting, f"import cycle: {' -> '.join(visiting + [module])}"
        if module in done or module not in graph:
            return
        visiting.append(module)
        for sibling in sorted(graph[module]):
            visit(sibling)
        visiting.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_no_function_is_longer_than_80_lines():
    long = []
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 80:
                    long.append(f"{path.name}:{node.lineno} {node.name} ({length} lines)")
    assert long == []
