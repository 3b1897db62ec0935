"""Hugging Face integration: `transformers` classes, export, import and lm-evaluation-harness; nothing imports
`transformers` at import time, and `register()` is explicit (docs/internals.md#keelhf)."""

from __future__ import annotations


def register() -> None:
    """Register `KeelConfig` and `KeelForCausalLM` with `AutoConfig` and `AutoModelForCausalLM` (needs
    `transformers`; calling it again does nothing new)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from keel.hf.configuration_keel import KeelConfig
    from keel.hf.modeling_keel import KeelForCausalLM

    AutoConfig.register(KeelConfig.model_type, KeelConfig, exist_ok=True)
    AutoModelForCausalLM.register(KeelConfig, KeelForCausalLM, exist_ok=True)


def quiet_progress() -> None:
    """No progress bars from `transformers` or `huggingface_hub` (writing shards, loading weights): the `keel`
    command prints its own lines. Library users who call `export_run` directly keep them."""
    import os

    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # also for what loads huggingface_hub later
    from huggingface_hub.utils import disable_progress_bars  # transformers' own dependency
    from transformers.utils import logging

    logging.disable_progress_bar()
    disable_progress_bars()
