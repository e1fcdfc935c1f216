"""Griffe extension for the API reference page (mkdocs.yml): read ``Example:`` sections as ``Examples:``.

shardax docstrings head their doctests with the Google-style ``Example:``; griffe only parses the plural as an
examples section (the singular becomes an admonition, and the ``>>>`` lines would render as quotes).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Rename a docstring's ``Example:`` heading to ``Examples:`` before it is parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
