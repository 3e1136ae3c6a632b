"""A griffe extension for the API reference: names that a package exports lazily, through a module ``__getattr__``.

``fastls`` imports its scikit-learn estimators on first use, so static analysis finds their names in
``fastls.__all__`` but not among the package's members. This adds each such name as an alias of the object that
a live import returns, wherever that object is defined: the reference names no private module.
"""

from __future__ import annotations

import importlib
import sys

import griffe


class LazyExports(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs) -> None:
        missing = [str(name) for name in pkg.exports or () if str(name) not in pkg.members]
        if not missing:
            return
        saved = sys.path[:]
        sys.path[:0] = [str(path) for path in loader.finder.search_paths]  # import what griffe reads
        try:
            module = importlib.import_module(pkg.path)
        finally:
            sys.path[:] = saved
        for name in missing:
            target = getattr(module, name)
            pkg.set_member(name, griffe.Alias(name, f"{target.__module__}.{target.__qualname__}", parent=pkg))
