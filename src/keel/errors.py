"""The errors a user can cause: the `keel` command prints a `KeelError` as one line and exits with code 2; any other
exception is a bug and keeps its traceback. Each is still a `ValueError` (docs/internals.md#keelerrors)."""

import importlib


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


def optional(module: str, extra: str, who: str, error: type[KeelError] = ConfigError, instead: str = ""):
    """`module` imported, or one `error` line: `who` needs the package that is missing (the one the import names:
    `torch.utils.tensorboard` needs `tensorboard`), installed with keel's `extra`."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        missing = (err.name or module).split(".")[0]
        raise error(f"{who} needs the optional package {missing!r}: pip install -c constraints.txt "
                    f"-e '.[{extra}]'{instead}") from None
