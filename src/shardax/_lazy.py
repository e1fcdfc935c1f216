"""Public faces that import their parts on first use (PEP 562), so that the launch path stays free of JAX.

``shardax launch``, ``shardax halos --processes N`` and the other jobs that start processes only start them: the
process that launches imports the command line and the process runner, not JAX (1.3 s on a small VM, spent again by
every process it starts). A package's ``__init__`` lists where each public name lives; :func:`attach` gives it the
module ``__getattr__`` and ``__dir__`` that import the part at the first access and keep the value, so later accesses
are plain attribute reads. Type checkers and documentation tools read the same names from the package's
``if TYPE_CHECKING:`` imports.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def attach(package: str, namespace: dict[str, Any], names: Mapping[str, str]) -> tuple[Callable[[str], Any],
                                                                                      Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the package ``package`` whose module dict is ``namespace``.

    Args:
        package: the package's ``__name__``.
        namespace: the package's ``globals()``; each resolved name is stored there.
        names: public name -> the module that defines it, relative to ``package`` (``"._errors"``), with
            ``":attr"`` where the module calls it otherwise (``"detect_launch": "._env:detect"``); a name that is a
            subpackage or submodule maps to itself (``"comm": ".comm"``) and resolves to the module.
    """

    def __getattr__(name: str) -> Any:
        where = names.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        where, _, attr = where.partition(":")
        module = importlib.import_module(where, package)
        value = module if where == f".{name}" and not attr else getattr(module, attr or name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__
