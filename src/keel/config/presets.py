"""`keel train`'s presets: whole TrainConfigs, one for every model preset (keel.model.sizes;
docs/internals.md#keelconfigpresets)."""

from __future__ import annotations

from keel.config.merge import merge
from keel.config.reads import TRAIN, Reads
from keel.config.schema import OptimConfig, RunConfig, TrainConfig
from keel.data.corpus import DataConfig
from keel.errors import ConfigError
from keel.model.sizes import PRESETS as MODEL_PRESETS
from keel.model.sizes import cpu_demo, tiny


# the README's main job: a 32-sub-layer Keel on the standard library's source, ~5 min on 2 cores. Its model is
# keel.cpu_demo() itself; it trains on sequences of 128 of the 256 that model takes
def _cpu_demo_train() -> TrainConfig:
    return TrainConfig(
        model=cpu_demo(),
        optim=OptimConfig(lr=2e-3, warmup_steps=30),
        run=RunConfig(steps=300, batch_size=16, seq_len=128, eval_every=100, eval_batches=10, ckpt_every=100),
    )


def _tiny_train() -> TrainConfig:  # for tests: seconds on a CPU
    return TrainConfig(
        model=tiny(max_seq_len=32),
        optim=OptimConfig(lr=3e-3, warmup_steps=5),
        run=RunConfig(steps=20, batch_size=4, seq_len=32, log_every=1, eval_every=10, eval_batches=2,
                      ckpt_every=10, progress=False),
    )


# The paper's recipe (../shared/PAPER.md section 5): sequences of 4096, a global batch of 1024 of them, AdamW
# (0.9, 0.95) with weight decay 0.01 and clipping 1.0, 2,500 warm-up steps, cosine to 1e-7, its peak learning rate
# for Keel at each depth, and the 250B tokens of its depth-scaling runs (Tables 2 and 3): 59,605 steps of
# 4,194,304 tokens. One process takes the global batch as 1 sequence x 1024 accumulated micro-batches (with N
# processes set run.grad_accum=1024/N), with activation checkpointing and compile. The paper does not state its
# vocabulary or tokenizer: a 32,000-token BPE trained on the data (offline) is used, and the data is the offline
# default until the user names theirs (`PAPER_DATA`).
PAPER_STEPS, PAPER_WARMUP, PAPER_BATCH = 59_605, 2_500, 1024
PAPER_LR = {64: 9e-3, 128: 9e-3, 512: 6e-3, 1024: 4.5e-3, 2048: 4.5e-3}  # 2048: beyond the paper, 1024's rate
# FineWeb-EDU's 10B-token sample, as `keel data prepare` reads it (docs/data.md; needs network, `datasets`)
PAPER_DATA = "data.source=hf:HuggingFaceFW/fineweb-edu data.hf_config=sample-10BT"


# `one_gpu` (paper-1024, paper-2048): AdamW's moments in 8 bits (torchao), so that by keel.scale.memory's plan
# 1024 sub-layers fit one 80 GB GPU and 2048 one 141 GB GPU (`--dry-run` prints it). The LR is the paper's for Keel
# at the depth: another scheme at a paper shape keeps it unless optim.lr is set (the paper trained Pre-LN at 3e-3)
def _paper_recipe(name: str, one_gpu: bool = False):
    def build() -> TrainConfig:
        model = MODEL_PRESETS[name]()
        return TrainConfig(model=model, data=DataConfig(tokenizer=f"bpe:{model.vocab_size}"),
                           optim=OptimConfig(lr=PAPER_LR[model.n_sublayers], warmup_steps=PAPER_WARMUP,
                                             state="8bit" if one_gpu else "float32"),
                           run=RunConfig(steps=PAPER_STEPS, batch_size=1, grad_accum=PAPER_BATCH, seq_len=4096,
                                         ac_every=1, compile=True))
    return build


PAPER_PRESETS = ("paper-64", "paper-128", "paper-512", "paper-1024", "paper-2048")
PRESETS = {name: _paper_recipe(name, one_gpu=name in ("paper-1024", "paper-2048")) for name in PAPER_PRESETS} \
    | {"cpu-demo": _cpu_demo_train, "tiny": _tiny_train}


DEFAULT_PRESET = "cpu-demo"


def train_preset(name: str | None = None) -> TrainConfig:
    name = name or DEFAULT_PRESET
    if name not in PRESETS:
        raise ConfigError(f"--preset: unknown preset {name!r}; allowed: {', '.join(PRESETS)}")
    return PRESETS[name]()


def load_config(overrides=(), config_file: str | None = None, preset: str | None = None,
                reads: Reads = TRAIN) -> TrainConfig:
    """A TrainConfig from a preset (default cpu-demo), an optional YAML file and dotted overrides; a field set
    that `reads` does not read is refused."""
    return merge(train_preset(preset), config_file, overrides, reads)
