"""Griffe extension for the API reference page (mkdocs.yml): read ``Example:`` sections as ``Examples:``, and
Sphinx cross-reference roles as inline code.

shardax docstrings head their doctests with the Google-style ``Example:``; griffe only parses the plural as an
examples section (the singular becomes an admonition, and the ``>>>`` lines would render as quotes). They also name
other objects with Sphinx roles (``:func:`potrs```, ``:class:`~shardax.particles.Particles```), which Markdown would
show with their role prefix; they become inline code (``~`` keeps the last component, as in Sphinx).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)
_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def _role(match: re.Match[str]) -> str:
    short, target = match.groups()
    return f"``{target.rsplit('.', 1)[-1] if short else target}``"


class ExampleSections(griffe.Extension):
    """Rename a docstring's ``Example:`` heading to ``Examples:`` and turn its Sphinx roles into inline code before it
    is parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_role, _EXAMPLE.sub(r"\1Examples:", obj.docstring.value))
