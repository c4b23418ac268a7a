"""Code an operator names in configuration, as ``"package.module:attribute"``.

A service that takes a plug-in (the trainer's initial policy and eval suite) depends
on the plug-in's signature, not on the package that provides it, so the layers stay
apart: the demo's plug-ins live in the simulated product, a team's in its own package.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class PluginError(ValueError):
    """A plug-in spec that is malformed or names nothing importable."""


def check_spec(spec: str) -> str:
    """The spec itself, if it has the ``module:attribute`` shape (nothing is imported)."""
    if not SPEC.match(spec):
        raise PluginError(f"{spec!r} is not a plug-in spec: expected 'package.module:attribute'")
    return spec


def load(spec: str) -> Any:
    """The attribute a spec names, importing its module."""
    module_name, attribute = check_spec(spec).split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise PluginError(
            f"plug-in {spec!r}: module {module_name!r} is not importable ({error})"
        ) from error
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise PluginError(
            f"plug-in {spec!r}: module {module_name!r} has no {attribute!r}"
        ) from None
