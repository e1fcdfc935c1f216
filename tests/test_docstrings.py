"""Every example in a public docstring runs and prints what it shows (doctest), on the 8 CPU devices of the tests.

A user copies these examples first: they must stay true as the code changes. Each public object of each
subpackage's ``__all__`` is one test; names are looked up in the module that defines the object, as ``doctest``
does for a module.
"""

from __future__ import annotations

import doctest
import importlib
import inspect

import pytest

SUBPACKAGES = ["shardax", "shardax.comm", "shardax.core", "shardax.fft", "shardax.fields", "shardax.io",
               "shardax.linalg", "shardax.nbody", "shardax.particles", "shardax.runtime", "shardax.spatial",
               "shardax.testing"]


def _public_objects() -> list[tuple[str, object]]:
    found: dict[int, tuple[str, object]] = {}
    for name in SUBPACKAGES:
        module = importlib.import_module(name)
        for attr in getattr(module, "__all__", ()):
            obj = getattr(module, attr)
            if not inspect.ismodule(obj) and id(obj) not in found and ">>>" in (inspect.getdoc(obj) or ""):
                found[id(obj)] = (f"{name}.{attr}", obj)
    return sorted(found.values(), key=lambda item: item[0])


OBJECTS = _public_objects()


def test_the_public_api_has_examples() -> None:
    assert len(OBJECTS) >= 80, [name for name, _ in OBJECTS]


@pytest.mark.parametrize("name, obj", OBJECTS, ids=[name for name, _ in OBJECTS])
def test_docstring_examples(name: str, obj: object) -> None:
    home = inspect.getmodule(obj)
    finder = doctest.DocTestFinder(recurse=False)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    tests = [t for t in finder.find(obj, name, module=home, globs=dict(vars(home)) if home else {}) if t.examples]
    assert tests, f"{name}: no example found"
    for test in tests:
        runner.run(test, out=report.append)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, "".join(report)
