"""Which fields of its merged config each command reads (`Reads`), and the declarations of keel's own commands
(bench and each experiment declare theirs beside their code)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Reads:
    """The fields one command reads of its merged config. The merge refuses any other field a YAML file or an
    override sets, never ignoring it: `<field>: not used by <command> (<why>)`.

    fields: dotted fields ("run.seq_len") or whole sections ("model"); "*" is every field.
    refuse: {field or section: why}, refused even inside `fields` (an experiment sets model.n_blocks per point).
    only: {field: values} read only at these values (bench reads model.scheme when it is one of --schemes).
    hints: {field or section: why} for a field not read; `why` for any other.
    keep_unchanged: a field outside `fields` may still be given at the base's own value (resume: the run's YAML).
    shorthand: the section a bare field belongs to (`scheme=pre_ln` is model.scheme).
    """

    command: str = ""  # "keel bench"; empty: "here" (an experiment: its error already starts with its name)
    fields: tuple[str, ...] = ("*",)
    why: str = ""
    refuse: Mapping[str, str] = field(default_factory=dict)
    only: Mapping[str, tuple] = field(default_factory=dict)
    hints: Mapping[str, str] = field(default_factory=dict)
    keep_unchanged: bool = False
    shorthand: str = "model"

    def refusal(self, key: str, base, config) -> str | None:
        """Why `key`, set in the file or the overrides, is refused (None: read). `base` and `config` are the
        merge's base and result: `only` and `keep_unchanged` compare values."""
        section = key.split(".", 1)[0]
        by = f"by {self.command}" if self.command else "here"
        for name in (key, section):
            if name in self.refuse:
                return f"{key}: not used {by} ({self.refuse[name]})"
        if key in self.only and _value(config, key) not in self.only[key]:
            return f"{key}: not used {by} ({self.hints.get(key) or self.why})"
        if "*" in self.fields or key in self.fields or section in self.fields:
            return None
        if self.keep_unchanged:
            before, after = _value(base, key), _value(config, key)
            if before == after:
                return None
            return f"{self.command}: {key}={after!r} differs from the run's config ({before!r}); {self.why}"
        return f"{key}: not used {by} ({self.hints.get(key) or self.hints.get(section) or self.why})"


def _value(node, key: str):
    for part in key.split("."):
        node = node.get(part) if isinstance(node, Mapping) else getattr(node, part, None)
    return node


TRAIN = Reads("keel train")
# what a resumed run may change; anything else must keep the run's value. run.batch_size may change when the
# number of processes does: the trainer checks that the global batch (batch_size x processes) stays what the
# checkpoint was written with
RESUMABLE = ("resume", "run.steps", "run.batch_size", "run.progress", "run.curves", "run.log_every", "run.eval_every",
             "run.eval_batches", "run.ac_every", "run.fsdp_group", "run.ckpt_every", "run.keep_checkpoints",
             "run.device", "run.compile", "run.fused_junction", "run.out_dir", "run.name", "run.telemetry_every",
             "run.log_to", "run.eval_tasks", "run.eval_tasks_every", "run.eval_tasks_items",  # scoring never trains
             "run.threads", "run.dtype")  # run.dtype as run.device: auto means bf16 on CUDA, float32 on a CPU
RESUME = Reads("resume", RESUMABLE, why="a resumed run must keep it", keep_unchanged=True)
SUMMARY = Reads("keel summary", ("model",), why="it describes the model: model.* fields only")
SUMMARY_OF_RUN = Reads("keel summary", (), why="it describes the run's model as it was trained")
TOKENIZER = Reads("keel tokenizer", ("data",), why="it trains a tokenizer on the corpus: data.* fields only",
                  shorthand="data")
