"""Helpers for tests that damage a run directory on purpose."""

import hashlib
import json
from pathlib import Path


def rechecksum(ckpt: Path) -> None:
    """Rewrite a checkpoint's manifest to match its (edited) files, so damage reaches the loader's content checks
    instead of stopping at the checksum."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for name in manifest:
        if name != "format":
            manifest[name] = hashlib.sha256((ckpt / name).read_bytes()).hexdigest()
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
