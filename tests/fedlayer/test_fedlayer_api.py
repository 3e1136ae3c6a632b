"""fedlayer's public functions, methods and classes are annotated, and every annotation resolves.

The check covers the modules whose hints this file was written with: the data, the models, the clock, the
plots, the validation helpers, the baselines and the MPI package. The names a module imports for its hints
only (under ``typing.TYPE_CHECKING``, e.g. ``mpi4py.MPI``) are imported here, in a fresh interpreter where
mpi4py, when present, is not initialized, so no test process ever starts MPI.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest

MODULES = [
    "fedlayer._validation",
    "fedlayer.data",
    "fedlayer.models",
    "fedlayer.plot",
    "fedlayer.timing",
    "fedlayer.baselines.client",
    "fedlayer.baselines.cohort",
    "fedlayer.baselines.estimators",
    "fedlayer.baselines.hyper",
    "fedlayer.baselines.models",
    "fedlayer.baselines.server",
    "fedlayer.mpi.hooks",
    "fedlayer.mpi.launch",
    "fedlayer.mpi.server",
    "fedlayer.mpi.wire",
    "fedlayer.mpi.worker",
    "fedlayer.algorithms",
    "fedlayer.checkpoint",
    "fedlayer.cli",
    "fedlayer.client",
    "fedlayer.messages",
    "fedlayer.options",
    "fedlayer.run",
    "fedlayer.secure",
    "fedlayer.secure_client",
    "fedlayer.server.grouping",
    "fedlayer.server.reference",
    "fedlayer.server.secure_sums",
    "fedlayer.server.solvers",
    "fedlayer.server.stages",
    "fedlayer.server.state",
    "fedlayer.transport",
]


def public_members(module_name):
    """{qualified name: function or class} of what ``module_name`` exports and defines itself.

    Classes bring their public methods (``__init__`` included) and properties defined in fedlayer, the
    methods they inherit from another fedlayer class included.
    """
    module = importlib.import_module(module_name)
    found = {}
    for name in module.__all__:
        obj = getattr(module, name)
        if getattr(obj, "__module__", None) != module_name:
            continue  # a re-export, or a constant: checked in its own module, or not a callable
        if inspect.isclass(obj):
            found[f"{module_name}.{name}"] = obj
            own = {key: value for cls in reversed(obj.__mro__) if cls.__module__.startswith("fedlayer")
                   for key, value in vars(cls).items()}
            for key, member in own.items():
                member = getattr(member, "__func__", getattr(member, "fget", member))
                if (inspect.isfunction(member) and member.__module__.startswith("fedlayer")  # not typing's
                        and (not key.startswith("_") or key == "__init__")):
                    found[f"{module_name}.{name}.{key}"] = member
        elif inspect.isfunction(obj):
            found[f"{module_name}.{name}"] = obj
    return found


def type_checking_names(module):
    """The names ``module`` imports under ``if TYPE_CHECKING:``, imported (for the hints that use them)."""
    namespace = {"__name__": module.__name__, "__package__": module.__package__}
    for node in ast.parse(Path(module.__file__).read_text()).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            exec(compile(ast.Module(node.body, type_ignores=[]), module.__file__, "exec"), namespace)
    return {key: value for key, value in namespace.items() if not key.startswith("__")}


def annotation_problems(module_names):
    """{qualified name: what is wrong with its hints} for every public member of ``module_names`` ([] if nothing)."""
    problems = {}
    for module_name in module_names:
        localns = type_checking_names(importlib.import_module(module_name))
        for name, obj in public_members(module_name).items():
            found = []
            try:
                hints = typing.get_type_hints(inspect.unwrap(obj), localns=localns)
            except Exception as err:  # a misspelt or missing name
                problems[name] = [f"hints do not resolve: {type(err).__name__}: {err}"]
                continue
            if not inspect.isclass(obj):
                parameters = [p for p in inspect.signature(obj).parameters if p not in ("self", "cls")]
                found += [f"parameter {p!r} has no type hint" for p in parameters if p not in hints]
                if "return" not in hints:
                    found.append("no return annotation")
            problems[name] = found
    return problems


# What the check covers, listed here (no MPI is imported to list it).
MEMBERS = sorted(name for module_name in MODULES for name in public_members(module_name))


@pytest.fixture(scope="module")
def problems():
    script = (
        "import importlib.util, json, runpy, sys\n"
        "if importlib.util.find_spec('mpi4py') is not None:\n"
        "    import mpi4py\n"
        "    mpi4py.rc.initialize = mpi4py.rc.finalize = False  # the types only, no MPI_Init\n"
        f"check = runpy.run_path({str(Path(__file__))!r})['annotation_problems']\n"
        f"print(json.dumps(check({MODULES!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_the_check_covers_the_public_api():
    expected = {"fedlayer.models.build_model", "fedlayer.models.Model.forward", "fedlayer.models.Conv2d.__init__",
                "fedlayer.data.load_federated", "fedlayer.timing.RoundLog.record", "fedlayer.plot.plot_results",
                "fedlayer.baselines.server.run_baseline", "fedlayer.baselines.models.BaselineModel.loss_and_grad",
                "fedlayer.mpi.server.MPITransport.sum_groups", "fedlayer.mpi.worker.serve",
                "fedlayer.models.TrainableLayer.n_outputs", "fedlayer.mpi.wire.Payload.nbytes"}
    assert expected <= set(MEMBERS)
    assert not any(part.startswith("_") and part != "__init__" for name in MEMBERS
                   for part in name.split(".")[2:])


@pytest.mark.parametrize("name", MEMBERS)
def test_public_members_are_annotated(name, problems):
    assert problems[name] == [], f"{name}: {problems[name]}"


def test_a_missing_hint_is_reported():
    # The check itself: a function without hints, a misspelt hint, and a complete one.
    module = types.ModuleType("fedlayer_api_probe")
    exec("def bare(x, *, y=1):\n    return x\n"
         "def misspelt(x: Nmber) -> int:\n    return x\n"
         "def complete(x: int, *rest: str) -> int:\n    return x\n"
         "__all__ = ['bare', 'misspelt', 'complete']\n", module.__dict__)
    for function in (module.bare, module.misspelt, module.complete):
        function.__module__ = module.__name__
    module.__file__ = __file__  # no TYPE_CHECKING block in this file's own body
    sys.modules[module.__name__] = module
    try:
        found = annotation_problems([module.__name__])
    finally:
        del sys.modules[module.__name__]
    assert found["fedlayer_api_probe.bare"] == ["parameter 'x' has no type hint", "parameter 'y' has no type hint",
                                                 "no return annotation"]
    assert found["fedlayer_api_probe.misspelt"][0].startswith("hints do not resolve: NameError")
    assert found["fedlayer_api_probe.complete"] == []
