"""Hugging Face integration: `transformers` classes, export, import and lm-evaluation-harness.

Nothing here imports `transformers` until it is used: `import keel` stays fast and works without it.
`register_on_transformers_import()` (called by `import keel`) registers `KeelConfig` and
`KeelForCausalLM` with the Auto classes as soon as `transformers` loads them, or at once if it already has.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

# the modules whose loading triggers a registration, and what to register then
_HOOKS = {
    "transformers.models.auto.configuration_auto": "register_config",
    "transformers.models.auto.modeling_auto": "register_model",
}


def register_config() -> None:
    from transformers.models.auto.configuration_auto import AutoConfig

    from keel.hf.configuration_keel import KeelConfig

    AutoConfig.register(KeelConfig.model_type, KeelConfig, exist_ok=True)


def register_model() -> None:
    from transformers.models.auto.modeling_auto import AutoModelForCausalLM

    from keel.hf.configuration_keel import KeelConfig
    from keel.hf.modeling_keel import KeelForCausalLM

    AutoModelForCausalLM.register(KeelConfig, KeelForCausalLM, exist_ok=True)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Runs a registration right after one of `_HOOKS`' modules has executed.

    Registering eagerly would mean importing `transformers`' model machinery (seconds) on every
    `import keel`, also for users who never touch `transformers`.
    """

    def __init__(self, pending: dict[str, str]):
        self.pending = pending

    def find_spec(self, name, path, target=None):
        if name not in self.pending:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        register = globals()[self.pending.pop(name)]
        loader_exec = spec.loader.exec_module

        def exec_module(module):
            loader_exec(module)
            register()

        spec.loader.exec_module = exec_module
        if not self.pending:
            sys.meta_path.remove(self)
        return spec


def register_on_transformers_import() -> None:
    """Register with the Auto classes now for what `transformers` has loaded, later for the rest."""
    if any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
        return
    pending = {}
    for module, register in _HOOKS.items():
        if module in sys.modules:
            globals()[register]()
        else:
            pending[module] = register
    if pending:
        sys.meta_path.insert(0, _RegisterAfterImport(pending))
