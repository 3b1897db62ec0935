"""Which run configs keel obeys: the paths and task files a travelling config.yaml names are followed only for a
config keel signed for this user, or one the user trusts (docs/reliability.md, "Trust")."""

from __future__ import annotations

import contextvars
import errno
import hashlib
import hmac
import os
import secrets
from contextlib import contextmanager
from pathlib import Path

from keel import safe_io
from keel.errors import ConfigError, DataError

SIGNATURE = ".config.sig"  # beside config.yaml in a run directory
TRUST_HINT = "--trust-config (or KEEL_TRUST_CONFIG=1)"


def _key(create: bool) -> bytes | None:
    """This user's signing key (created, readable by the user only, when `create`); None when there is none."""
    base = os.environ.get("KEEL_CONFIG_DIR") or Path(os.environ.get("XDG_CONFIG_HOME") or "~/.config") / "keel"
    path = Path(base).expanduser() / "trust.key"
    if create and not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
        except OSError as err:
            if err.errno != errno.EEXIST:  # another process made it first: read theirs
                return None
    try:
        key = safe_io.read_regular(path, 64)
    except (OSError, DataError):
        return None
    return key if len(key) == 32 else None


def _signature(key: bytes, config: bytes) -> str:
    return hmac.new(key, b"keel-config-1\0" + config, hashlib.sha256).hexdigest()


def sign(run_path: Path) -> None:
    """Mark `run_path`'s config.yaml (just written by keel) as this user's; silently nothing without a key
    (a read-only home): the run is then treated as from elsewhere."""
    key = _key(create=True)
    config = safe_io.read_bytes(run_path, run_path / "config.yaml", safe_io.CAP_SMALL)
    if key is not None and config is not None:
        safe_io.write_text(run_path, run_path / SIGNATURE, _signature(key, config) + "\n")


_TRUST_ALL = contextvars.ContextVar("keel_trust_config", default=False)


@contextmanager
def trusting(trust: bool = True):
    """Within this block every run's config is trusted when `trust` (a command's --trust-config), as with
    KEEL_TRUST_CONFIG=1 but for this call only."""
    token = _TRUST_ALL.set(trust or _TRUST_ALL.get())
    try:
        yield
    finally:
        _TRUST_ALL.reset(token)


def trusted(run_path: Path) -> bool:
    """Whether keel wrote `run_path`'s config.yaml, as it is now, for this user (or KEEL_TRUST_CONFIG=1, or
    inside `trusting()`)."""
    if os.environ.get("KEEL_TRUST_CONFIG") == "1" or _TRUST_ALL.get():
        return True
    key = _key(create=False)
    try:
        config = safe_io.read_bytes(run_path, run_path / "config.yaml", safe_io.CAP_SMALL)
        signature = safe_io.read_bytes(run_path, run_path / SIGNATURE, 128)
    except DataError:
        return False
    if key is None or config is None or signature is None:
        return False
    return hmac.compare_digest(signature.decode("ascii", "replace").strip(), _signature(key, config))


def check_data_paths(run_path: Path, data, trust: bool = False, tokenizer: bool = True) -> None:
    """Refuse (DataError, one line naming the field) a path in `data` (the run's DataConfig) that lies outside
    the run directory, unless the run is trusted. `tokenizer=False` leaves data.tokenizer out, for commands
    that use the run's own saved tokenizer instead."""
    from keel.data.tokenizer import is_bpe  # noqa: PLC0415 (numpy and tokenizers: not for `keel --help`)

    if trust or trusted(run_path):
        return
    fields = {"data.source": "" if data.source == "stdlib" else data.source, "data.cache_dir": data.cache_dir}
    if tokenizer and not (data.tokenizer == "bytes" or is_bpe(data.tokenizer)):  # a built-in one, not a file
        fields["data.tokenizer"] = data.tokenizer
    root = Path(run_path).resolve()
    for field, value in fields.items():
        if value and (value.startswith("hf:") or not Path(value).expanduser().resolve().is_relative_to(root)):
            raise DataError(f"{run_path / 'config.yaml'}: {field}={value} lies outside the run directory, and "
                            "this config was not written by keel for you (a downloaded or copied run); keel does "
                            f"not follow its paths unless you trust it: {TRUST_HINT}")


def check_task_files(run_path: Path, tasks, trust: bool = False) -> None:
    """Refuse (ConfigError, one line naming run.eval_tasks) a task file (`lm_eval:<path>.yaml`, which can run
    code) among `tasks`, the entries of run.eval_tasks that came from the run's config.yaml rather than from
    the user, unless the run is trusted; wherever the file lies, the run directory included."""
    from keel.evals.tasks import is_task_file

    files = [name for name in tasks if is_task_file(name)]
    if not files or trust or trusted(run_path):
        return
    raise ConfigError(f"{run_path / 'config.yaml'}: run.eval_tasks names the task file {files[0]!r}, and this "
                      "config was not written by keel for you (a downloaded or copied run); a task file can run "
                      "code, so keel loads it only when you name it (run.eval_tasks=... on the command line) or "
                      f"trust the config: {TRUST_HINT}")
