"""The one config merge every command uses (preset < YAML file < dotted overrides), and configs to and from YAML."""

from __future__ import annotations

import difflib
import os
import re
import stat
from dataclasses import fields, is_dataclass
from pathlib import Path

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from keel.config.reads import TRAIN, Reads
from keel.config.schema import RunConfig, TrainConfig, check_limits, validate, validate_runtime
from keel.errors import ConfigError
from keel.model.sizes import PRESETS as MODEL_PRESETS


def merge(base, config_file: str | None = None, overrides=(), reads: Reads | None = None):
    """The one config merge, for every command: `base` (a dataclass instance: a preset, an experiment's
    defaults, a run's own config) < a YAML file < dotted `key=value` overrides. OmegaConf checks every key and
    type against the dataclasses; a wrong key, type or value is one ConfigError naming the field. A field set
    that the command does not read (`reads`; default: the merged config's own `reads()`, else every field) is
    refused the same way, whether the file or an override set it."""
    declared = reads or (base.reads() if hasattr(base, "reads") else TRAIN)
    layers = [_structured(base)]
    if config_file:
        path = Path(config_file)
        loaded = load_yaml(path, f"config file {path}")
        if not OmegaConf.is_dict(loaded):
            raise ConfigError(f"config file {path}: expected a mapping of sections at the top level")
        try:  # an interpolation (${...}) to a key that is not there, or one that loops
            OmegaConf.to_container(loaded, resolve=True)
        except OmegaConfBaseException as err:
            raise ConfigError(f"config file {path}: {str(err).splitlines()[0]}") from None
        for key in loaded:
            section = getattr(base, str(key), None)
            if is_dataclass(section) and not OmegaConf.is_dict(loaded[key]):
                raise ConfigError(f"config file {path}: {key}: expected a mapping of {type(section).__name__} "
                                  f"fields, got {loaded[key]!r}")
        layers.append(loaded)
    given = list(_leaves(loaded, "")) if config_file else []
    for item in overrides:
        if "=" not in item or item.startswith("="):
            example = "model.n_blocks=8" if isinstance(base, TrainConfig) else "run.steps=100"
            raise ConfigError(f"override {item!r}: expected key=value, e.g. {example}")
        if not item.isprintable():
            raise ConfigError(f"{item.split('=', 1)[0]}: the value holds control characters; allowed: printable text")
    short = getattr(base, declared.shorthand, None)  # a bare field of that section: `scheme=pre_ln`
    if is_dataclass(short):
        bare = {f.name for f in fields(short)} - {f.name for f in fields(base)}
        overrides = [f"{declared.shorthand}.{o}" if o.split("=", 1)[0] in bare else o for o in overrides]
    overrides = [_as_list(base, _sublayers(base, o)) for o in overrides]
    try:
        layers.append(OmegaConf.from_dotlist(list(overrides)))
    except Exception as err:  # OmegaConf's own errors, and YAML's for values it cannot read
        raise ConfigError(f"overrides: {str(err).splitlines()[0]}") from None
    given += [o.split("=", 1)[0] for o in overrides]
    config = to_config(layers, type(base))
    reads = reads or (config.reads() if hasattr(config, "reads") else TRAIN)
    for key in dict.fromkeys(given):
        refused = reads.refusal(key, base, config)
        if refused:
            raise ConfigError(refused)
    return config


_STRUCTURED: dict = {}


def _structured(base):
    """OmegaConf.structured(base), made once per distinct base (about 10 ms for a TrainConfig, two thirds of a merge):
    OmegaConf.merge copies its first layer, so the one kept is never changed. A dataclass's repr holds every field."""
    key = (type(base), repr(base))
    if key not in _STRUCTURED:
        if len(_STRUCTURED) >= 64:
            _STRUCTURED.clear()
        _STRUCTURED[key] = OmegaConf.structured(base)
    return _STRUCTURED[key]


def load_yaml(path, name: str):
    """A YAML file a user named, as OmegaConf reads it (1e-3 is a number); `name` starts each ConfigError: not a
    regular file of at most 16 MiB (a FIFO would block, /dev/zero never end), not YAML, a key given twice (YAML
    would keep the last), or nested too deeply (YAML's composer recurses once per level)."""
    try:
        info = os.stat(path)
    except OSError as err:
        raise ConfigError(f"{name}: {(err.strerror or str(err)).lower()}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{name}: not a regular file")
    if info.st_size > 16 << 20:
        raise ConfigError(f"{name}: larger than 16 MiB, refused")
    try:
        with open(path, "rb") as f:  # in Python first: OmegaConf's C loader overflows the C stack on deep nesting
            yaml.compose(f, Loader=yaml.SafeLoader)
        return OmegaConf.load(path)
    except RecursionError:
        raise ConfigError(f"{name}: nested too deeply to be a config") from None
    except yaml.MarkedYAMLError as err:
        where = f"line {err.problem_mark.line + 1}: " if err.problem_mark else ""
        duplicate = (err.problem or "").removeprefix("found duplicate key ")
        problem = f"duplicate key {duplicate!r}" if duplicate != err.problem else f"not valid YAML ({err.problem})"
        raise ConfigError(f"{name}: {where}{problem}") from None
    except Exception as err:  # bytes that are not UTF-8, a mapping used as a key
        raise ConfigError(f"{name}: not valid YAML ({str(err).splitlines()[0]})") from None


# `model.n_sublayers=32` (or bare `n_sublayers=32`), depth in the unit every command counts it in, is model.n_blocks=16
def _sublayers(base, item: str) -> str:
    key, value = item.split("=", 1)
    if key not in ("n_sublayers", "model.n_sublayers") or not is_dataclass(getattr(base, "model", None)):
        return item
    try:
        n = int(value.strip())
    except ValueError:
        n = None
    if n is None or n < 2 or n % 2:
        raise ConfigError(f"model.n_sublayers: got {value!r}; allowed: an even number >= 2 (one attention and one "
                          "FFN sub-layer a block; model.n_blocks = n_sublayers / 2)")
    return f"model.n_blocks={n // 2}"


def _leaves(node, prefix: str):  # the dotted keys a YAML file sets: `run: {steps: 5}` sets run.steps
    for key, value in node.items():
        if OmegaConf.is_dict(value):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


# words YAML 1.1 (what OmegaConf parses an override's value with) reads as a boolean or null
YAML_WORDS = {"on", "off", "yes", "no", "y", "n", "true", "false", "null", "~"}


# `run.log_to=tensorboard` for a list field means `run.log_to=[tensorboard]` (and `a,b` means `[a,b]`): the brackets
# are easy to forget, and unquoted they are a glob to zsh. For a text field, a word YAML would read as a boolean or
# null is kept as the text typed: `run.fused_junction=off` is "off", not False
def _as_list(base, item: str) -> str:
    key, value = item.split("=", 1)
    parts = key.split(".")
    node = _node(base, parts[:-1])
    if not is_dataclass(node) or value.lstrip().startswith("["):
        return item
    kind = str({f.name: f.type for f in fields(node)}.get(parts[-1], ""))  # "list[str]", or the type itself
    if kind.removeprefix("typing.").lower().startswith("list[") and value.strip():
        return f"{key}=[{value}]"
    if kind in ("str", "<class 'str'>") and value.strip().lower() in YAML_WORDS:
        return f"{key}='{value.strip()}'"
    return item


def _node(root, parts):
    for part in parts:
        root = getattr(root, part, None)
    return root


# ' (did you mean run.steps?)': for a section-less key, the sections that have such a field (else, for a typo, the
# closest top-level or section fields); for any other unknown key, the closest field names of its section
def _suggest(key: str, schema) -> str:
    default = schema()
    if "." in key:
        section, leaf = key.rsplit(".", 1)
        node = _node(default, section.split("."))
        names = [f.name for f in fields(node)] if is_dataclass(node) else []
        hits = [f"{section}.{n}" for n in difflib.get_close_matches(leaf, names, n=2)]
    else:
        sections = {f.name: getattr(default, f.name) for f in fields(default)}
        pairs = [(g.name, f"{name}.{g.name}") for name, s in sections.items() if is_dataclass(s) for g in fields(s)]
        nested = dict(pairs)
        hits = [dotted for leaf, dotted in pairs if leaf == key]
        hits = hits or [nested.get(m, m) for m in difflib.get_close_matches(key, [*sections, *nested], n=2)]
    return f" (did you mean {' or '.join(hits)}?)" if hits else ""


# a key as an error message shows it: a file that is not a config (YAML reads /etc/passwd as one long key) is not
# echoed back whole
def _short(text: str, limit: int = 60) -> str:
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


def to_config(layers, schema=None):
    schema = schema or TrainConfig
    try:
        config = OmegaConf.to_object(OmegaConf.merge(*layers))
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        first = str(err).splitlines()[0]
        unknown = re.match(r"Key '(.+)' not in '(\w+)'", first)
        if unknown:  # the wording keel uses everywhere, plus the section a bare key probably belongs to
            first = f"{unknown[2]} has no field {_short(unknown[1])!r}{_suggest(key, schema)}"
        raise ConfigError(f"{_short(key)}: {first}" if key else _short(first, 300)) from None
    except ValueError as err:  # ModelConfig's own validation, which names its field ("ModelConfig.alpha: ...")
        raise ConfigError(str(err)) from None
    if isinstance(config, TrainConfig):
        validate(config)
    elif isinstance(getattr(config, "run", None), RunConfig):  # an experiment: its points validate the rest
        check_limits(config)
        validate_runtime(config.run)
    return config


def add_config_arguments(p) -> None:
    """--preset, --config and key=value overrides: the same three layers, with the same meaning, everywhere."""
    p.add_argument("--preset", choices=list(MODEL_PRESETS),  # keel.config.presets: one for each
                   help="cpu-demo (default: the README's main job), tiny (tests), or a paper-sized model "
                        "(paper-64 .. paper-2048) with the paper's recipe (paper-1024/2048: sized for one GPU)")
    p.add_argument("--config", help="a YAML file with any of model/data/optim/guard/run")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted overrides, e.g. model.n_blocks=8 run.steps=500 (a bare model field such as "
                        "scheme=pre_ln means model.scheme)")


def to_yaml(config: TrainConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def load_run_config(run_dir: Path) -> TrainConfig:
    """A run's config.yaml; a damaged one is blamed on the file, not on whatever field it broke."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir}: not a Keel run directory (no config.yaml)")
    loaded = load_yaml(path, f"{path}: damaged run config")
    try:
        if not OmegaConf.is_dict(loaded):
            raise ConfigError("expected a mapping of sections at the top level")
        return to_config([_structured(TrainConfig()), loaded])
    except Exception as err:  # a field of the wrong type or value: a damaged file too
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"{path}: damaged run config ({reason})") from None
