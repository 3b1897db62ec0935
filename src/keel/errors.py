"""The errors a user can cause. The `keel` command prints a `KeelError` as one line and exits with code 2;
any other exception is a bug and keeps its traceback.

Each subclass is still a `ValueError`, so code that validated input before this module existed keeps working.
`keel.model` raises plain `ValueError`s (it imports nothing from keel); the config layer re-raises them as
`ConfigError`s naming the `model.` field.
"""


class KeelError(ValueError):
    """Bad input: the message names the field or file and what is allowed."""


class ConfigError(KeelError):
    """A configuration that cannot run."""


class DataError(KeelError):
    """A corpus, tokenizer or token cache that cannot be read."""


class CheckpointError(KeelError):
    """A checkpoint that cannot be loaded."""


class ExportError(KeelError):
    """A model that cannot be exported or imported."""
