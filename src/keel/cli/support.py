"""What the `keel` command does around its sub-commands (signals, argparse errors, threads, the paths it is given),
without importing torch (docs/internals.md#keelclisupport)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from keel import runtime
from keel.errors import ConfigError

DIVERGED_EXIT = 3  # `keel train`: the run diverged (diverged.json says where and why)
INTERRUPTED_EXIT = 130  # 128 + SIGINT, as shells report Ctrl-C
BROKEN_PIPE_EXIT = 141  # 128 + SIGPIPE, as shells report a reader that went away
PLOT_FORMATS = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


# ---- signals --------------------------------------------------------------------------------------------
def run_interruptible(work: Callable[[], int]) -> int:
    """`work()`, with Ctrl-C or SIGTERM at any moment, also while torch imports (seconds), one line and exit 130.
    A training run handles them itself (a checkpoint at the step boundary); this is for everything around it."""
    runtime.PENDING_SIGNALS.clear()
    try:
        previous = {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # called off the main thread: leave signals alone
        previous = {}
    try:
        code = work()
        if runtime.PENDING_SIGNALS and code == 0:  # a signal whose KeyboardInterrupt was swallowed on the way
            raise KeyboardInterrupt
        return code
    except BrokenPipeError:  # `keel ... | head` closed the pipe: stop quietly, as other command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit would fail again
        return BROKEN_PIPE_EXIT
    except (KeyboardInterrupt, Exception) as err:
        # a signal's KeyboardInterrupt can come out as another exception: Python wraps one raised inside a class
        # body's __set_name__ in a RuntimeError (seen when SIGTERM landed in triton's import), and an import it cut
        # short can fail later. The user asked to stop: one line, exit 130, as for the plain KeyboardInterrupt
        if not isinstance(err, KeyboardInterrupt) and not runtime.PENDING_SIGNALS:
            raise
        return _interrupted()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _interrupted() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not cut the message short
    print("keel: interrupted", file=sys.stderr, flush=True)
    return INTERRUPTED_EXIT


def _raise_interrupt(signum, frame):
    runtime.PENDING_SIGNALS.append(signum)
    if _importing(frame):
        # raised inside an import, the KeyboardInterrupt can cross a native module's initialiser, which aborts the
        # process (SIGABRT, seen with torch's imports under load); an import writes nothing of the user's, so stop
        # here: one line, exit 130
        os._exit(_interrupted())
    raise KeyboardInterrupt


def _importing(frame) -> bool:  # a frame of importlib's bootstrap below `frame`
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


# ---- argparse ----------------------------------------------------------------------------------------------
class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one `keel: error:` line and exit 2 (sub-commands inherit it)."""

    def error(self, message):
        print(error_line(f"{self.prog.removeprefix('keel ')}: {message}" if self.prog != "keel" else message),
              file=sys.stderr)
        sys.exit(2)


class DefaultsShown(argparse.HelpFormatter):
    """`(default: ...)` after an option's help, unless it says its default itself or has none to show."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "(default" in text or not action.option_strings or any(action.default is v for v in (None, False,
                                                                                                argparse.SUPPRESS)):
            return text
        return text + (" (default: %(default)r)" if isinstance(action.default, str) else " (default: %(default)s)")


# ---- paths and files named on the command line ------------------------------------------------------------
def output_path(value: str, flag: str, suffixes, owned=()) -> Path:
    """An output file named on the command line, checked before any work: a known format, an existing
    parent directory, not a directory, and never a file inside someone's run directory (a run's files are
    written only by the command that owns them)."""
    out = Path(value)
    if out.suffix.lower() not in suffixes:
        raise ConfigError(f"{flag} {value}: unknown format {out.suffix or '(none)'!r}; "
                          f"allowed: {', '.join(suffixes)}")
    if not out.parent.is_dir():
        raise ConfigError(f"{flag} {value}: no such directory {out.parent}")
    if out.is_dir():
        raise ConfigError(f"{flag} {value}: is a directory; give a file name")
    for parent in (out.parent, out.parent.parent):
        if any(parent.resolve() == Path(o).resolve() for o in owned):
            continue
        if (parent / "run.json").exists() or (parent / "config.yaml").exists() and (parent / "checkpoints").exists():
            raise ConfigError(f"{flag} {value}: inside the run directory {parent}; "
                              "keel does not overwrite a run's files")
    return out


def writable(out: Path, flag: str) -> Path:
    """`out` (an output file, checked by `output_path`) once a file can be made beside it and no link is there: one
    line before any work, not an OSError after it (keel.safe_io writes the file and never follows a link)."""
    if out.is_symlink():
        raise ConfigError(f"{flag} {out}: is a symbolic link; give the file itself")
    _can_write(out.parent, flag, out)
    return out


def _can_write(directory: Path, flag: str, shown: Path) -> None:
    import secrets

    probe = directory / f".keel-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        os.unlink(probe)
    except OSError as err:
        raise ConfigError(f"{flag} {shown}: cannot write in {directory} ({err.strerror or err})") from None


def flag_limits() -> dict:
    """{"<command> --flag": Limit} for every numeric flag of every `keel` command, checked (`check_flags`) right
    after the command line is parsed, before any file is read or torch loads (docs/training.md#allowed-values)."""
    from keel.config.schema import Limit, count  # noqa: PLC0415

    return {
        "eval --batches": count(0, 2**24, "0: the run's run.eval_batches"),
        "generate --max-new-tokens": count(0, 1_000_000),
        # sampling runs in float32: a temperature below 1e-6 makes the logits inf, a top-p below it rounds to 0 and
        # drops every token; either way the probabilities are NaN. Both are greedy long before that
        "generate --temperature": Limit(1e-6, 1e4, or_zero="greedy"),
        "generate --top-k": count(0, 2**24, "0: off"),
        "generate --top-p": Limit(1e-6, 1, note="1: off"),
        "generate --seed": count(0, 2**63 - 1),
        "tokenizer --vocab-size": count(257, 2**24, "256 bytes and the end-of-text token at least"),
        "data prepare --workers": count(1, 256),
        "data prepare --shard-tokens": count(1, 2**32 - 1),  # a shard's token count is a uint32 in its manifest
        "data prepare --bpe-sample": count(1, 2**40, "documents"),
        "lm-eval --num-fewshot": count(0, 10_000),
        "lm-eval --limit": Limit(0, 2**31, open_low=True, note="examples per task; a fraction of them if < 1"),
        "lm-eval --batch-size": count(1, 2**16),
        "bench --steps": count(1, 100_000),
        "bench --warmup": count(0, 100_000),
        "bench --depth-steps": count(1, 100_000),
    }


def add_data_arguments(p, example: str) -> None:  # --config and data.* overrides, as keel train spells them
    p.add_argument("--config", help="a YAML file; its data section is read")
    p.add_argument("overrides", nargs="*", metavar="key=value", help=f"data.* fields, as keel train spells them, e.g. "
                   f"{example} (a bare field such as {example.split()[0].removeprefix('data.')} means data.source)")


def check_flags(args) -> None:
    """The parsed command line's numeric flags, each in its range (`flag_limits`): one ConfigError naming the first
    that is not. A flag left out (None) is the command's own default."""
    command = " ".join(filter(None, (getattr(args, "command", None), getattr(args, "data_command", None))))
    for key, limit in flag_limits().items():
        name, flag = key.rsplit(" ", 1)
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if name == command and value is not None:
            limit.check(flag, value)


def output_dir(value: str | None, flag: str, empty: bool = False, make: bool = True) -> Path | None:
    """An output directory named on the command line (made if missing), checked before any work: never a link, a
    file, a device or a directory this user cannot write (/proc, read-only), and, with `empty`, new or empty.
    `make=False`: checked, not made (the command makes it once its work is done, as export-hf does)."""
    if not value:
        return None
    out = Path(value)
    if out.is_symlink():
        raise ConfigError(f"{flag} {out}: is a symbolic link; give the directory itself")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{flag} {out}: exists and is not a directory")
    if empty and out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"{flag} {out}: already exists and is not empty; choose a new output directory")
    if not make and not out.exists():
        above = next((p for p in out.absolute().parents if p.exists()), Path("/"))
        if not above.is_dir():
            raise ConfigError(f"{flag} {out}: {above} is not a directory")
        _can_write(above, flag, out)
        return out
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{flag} {out}: cannot make it ({err.strerror or err})") from None
    _can_write(out, flag, out)
    return out


# ---- output -----------------------------------------------------------------------------------------------
def error_line(message) -> str:
    """`keel: error: <message>` as one line: an argument's newline or escape sequence (echoed back in the
    message) is shown escaped, never acted on by the terminal."""
    return "keel: error: " + printable(str(message), keep="")


def printable(text: str, keep: str = "\n\t") -> str:
    """`text` with control characters other than those in `keep` escaped (`\\r`, `\\x1b`): a model's output
    must not move the cursor, clear the screen or retitle the terminal."""
    return "".join(ch if ch.isprintable() or ch in keep else ch.encode("unicode_escape").decode("ascii") for ch in text)
