"""Working without the Hugging Face Hub: one quick look whether it can be reached before anything downloads
(docs/internals.md#keeldatahub)."""

from __future__ import annotations

import os
import sys
import threading
import urllib.error
import urllib.request

DEFAULT_ENDPOINT = "https://huggingface.co"  # huggingface_hub's, overridden by HF_ENDPOINT as there


def hub_offline_unless_reachable(timeout: float = 3.0) -> str | None:
    """Unless HF_HUB_OFFLINE is set either way, work offline (HF_HUB_OFFLINE=1, HF_DATASETS_OFFLINE=1, here and in
    huggingface_hub and datasets) when the Hub gives no answer within `timeout` seconds; returns why, or None."""
    if "HF_HUB_OFFLINE" in os.environ:
        return None
    reason = unreachable(timeout)
    if reason is not None:
        _go_offline()
    return reason


def unreachable(timeout: float) -> str | None:
    """Why the Hub (HF_ENDPOINT, else huggingface.co) gives no answer to a HEAD request within `timeout` seconds,
    or None when it answers, or when the way to it is a proxy urllib cannot take (ALL_PROXY alone, or SOCKS), which
    huggingface_hub's own requests do take: they report what happens there."""
    proxies = urllib.request.getproxies()
    via = proxies.get("https") or proxies.get("all")
    if via and (not proxies.get("https") or via.lower().startswith("socks")):
        return None
    endpoint = os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")
    result: list[str | None] = []

    def probe():
        try:
            urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout).close()
            result.append(None)
        except urllib.error.HTTPError:  # an answer, if not a happy one
            result.append(None)
        except (OSError, ValueError) as err:  # URLError, refused, timed out; ValueError: not a URL
            reason = getattr(err, "reason", None) or err
            result.append(f"{endpoint}: {reason}")

    # a name lookup is not bound by `timeout` (a resolver that hangs would hang urlopen): the thread is
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout + 1.0)
    return result[0] if result else f"{endpoint}: no answer within {timeout:g} s"


def _go_offline() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    if (constants := sys.modules.get("huggingface_hub.constants")) is not None:
        constants.HF_HUB_OFFLINE = True  # what huggingface_hub.is_offline_mode() (and transformers) reads
    if (config := sys.modules.get("datasets.config")) is not None:
        config.HF_HUB_OFFLINE = config.HF_DATASETS_OFFLINE = True
