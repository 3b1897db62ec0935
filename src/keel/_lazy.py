"""Names of a package that load from its modules on first use (PEP 562), so a light import stays light."""

from __future__ import annotations

import importlib
import sys


def lazy_names(package: str, homes: dict[str, tuple[str, ...]]):
    """`__getattr__`, `__dir__` and `__all__` for `package`, whose names live in its modules: `homes` maps a
    module's name to the names it defines. A name's module is imported when the name is first looked up."""
    home = {name: module for module, names in homes.items() for name in names}

    def __getattr__(name: str):
        if name in home:
            value = getattr(importlib.import_module(f"{package}.{home[name]}"), name)
            setattr(sys.modules[package], name, value)  # looked up once
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted(set(vars(sys.modules[package])) | set(home))

    return __getattr__, __dir__, list(home)
