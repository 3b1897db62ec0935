"""The errors a user can cause: the `keel` command prints a `KeelError` as one line and exits with code 2; any other
exception is a bug and keeps its traceback. Each is still a `ValueError` (docs/internals.md#keelerrors)."""


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
