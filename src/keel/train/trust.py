"""Which run configs keel obeys: the trust model for run directories from elsewhere.

A run directory travels (downloaded, shared, copied from a colleague), and its config.yaml names files:
data.source (read), data.cache_dir (written: the token cache) and data.tokenizer (read). Obeying a stranger's
config as if the user had typed it would let it read any file the user can (data.source=~/.ssh/id_rsa) and
write its bytes, as token ids, wherever it likes (data.cache_dir=/a/shared/dir). As `trust_remote_code` does
for transformers, keel therefore follows those paths only when one of these holds:
- the run's config was written by keel for this user: keel signs each config.yaml it writes with a key only
  this user can read (HMAC-SHA256, key in $KEEL_CONFIG_DIR or ~/.config/keel), so a run trained or imported
  here is trusted and a downloaded one, whose signature no key here matches, is not;
- the path lies inside the run directory itself, or is the built-in corpus ("stdlib"), or is empty (the
  user's own default cache);
- the user trusts the config explicitly: KEEL_TRUST_CONFIG=1, `--trust-config` on `keel eval` or on
  `keel train resume=RUN` (`trusting()`), or `trust=True` to `evaluate_run`.
Anything else is refused in one line naming the field, before a byte is read or written. The model's sizes
are checked whatever the trust (keel.train.untrusted.check_model_fits): a checkpoint is data, not a config.
"""

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
from keel.errors import DataError

SIGNATURE = ".config.sig"  # beside config.yaml in a run directory
_TOKENIZER_SPECS = ("bytes", "bpe")


def _key_path() -> Path:
    base = os.environ.get("KEEL_CONFIG_DIR") or Path(os.environ.get("XDG_CONFIG_HOME") or "~/.config") / "keel"
    return Path(base).expanduser() / "trust.key"


def _key(create: bool) -> bytes | None:
    """This user's signing key (created, readable by the user only, when `create`); None when there is none."""
    path = _key_path()
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
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            key = f.read(64)
    except OSError:
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
    if trust or trusted(run_path):
        return
    fields = {"data.source": "" if data.source == "stdlib" else data.source, "data.cache_dir": data.cache_dir}
    if tokenizer and not data.tokenizer.startswith(_TOKENIZER_SPECS):
        fields["data.tokenizer"] = data.tokenizer
    root = Path(run_path).resolve()
    for field, value in fields.items():
        if value and (value.startswith("hf:") or not Path(value).expanduser().resolve().is_relative_to(root)):
            raise DataError(f"{run_path / 'config.yaml'}: {field}={value} lies outside the run directory, and "
                            "this config was not written by keel for you (a downloaded or copied run); keel does "
                            "not follow its paths unless you trust it: --trust-config (or KEEL_TRUST_CONFIG=1)")
