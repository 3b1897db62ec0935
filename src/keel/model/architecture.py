"""The model's configuration: one frozen dataclass, validated before any tensor exists."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from keel.model.schemes import SCHEME_OPTIONS, SCHEMES

FFN_TYPES = ("swiglu", "gelu")
NORM_TYPES = ("rmsnorm", "layernorm")


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only causal LM. Depth is counted in blocks (one attention + one FFN sub-layer);
    the paper's L is `n_sublayers = 2 * n_blocks`, also for a looped model (`loop_blocks`: TransformerLM).

    Scheme-specific fields default to None ("the scheme's default") and are rejected when set for a
    scheme that does not read them.
    """

    vocab_size: int = 256
    d_model: int = 256
    n_blocks: int = 8
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: as many as n_heads (plain multi-head attention)
    d_ffn: int | None = None  # None: 3 * d_model (the paper's Table 8)
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    ffn: str = "swiglu"
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    dropout: float = 0.0
    tie_embeddings: bool = False
    init_std: float = 0.02
    scheme: str = "keel"
    loop_blocks: int | None = None  # None: n_blocks distinct blocks; k: k blocks applied n_blocks/k times
    # keel
    alpha: int | float | str | None = None  # "L" (default), "sqrtL" or a number > 0
    first_layer: str | None = None  # "v2" (default), "v1" or "none"
    # mix_ln
    mix_ln_fraction: float | None = None  # share of blocks that are Post-LN; default 0.25
    # deepnorm
    deepnorm_beta: str | None = None  # "deepnet" (default) or "paper"

    def __post_init__(self):
        _validate(self)

    @property
    def n_sublayers(self) -> int:
        """The paper's L: attention and FFN sub-layers counted separately."""
        return 2 * self.n_blocks

    @property
    def distinct_blocks(self) -> int:
        """Blocks with their own weights: `loop_blocks` for a looped model, else `n_blocks`."""
        return self.n_blocks if self.loop_blocks is None else self.loop_blocks

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn_dim(self) -> int:
        return 3 * self.d_model if self.d_ffn is None else self.d_ffn

    def scheme_kwargs(self) -> dict:
        """The scheme-specific fields the chosen scheme reads, for its constructor."""
        return {name: getattr(self, name) for name in SCHEMES[self.scheme].options}

    def scheme_options_shown(self) -> dict[str, str]:
        """{option: how it reads} for the chosen scheme's own options, as `keel summary` and the model card
        print them: `{"alpha": "L = 32 (default)", "first_layer": "'v1'"}`."""
        scheme = SCHEMES[self.scheme]
        return {name: scheme.shown(name, getattr(self, name), self.n_sublayers) for name in scheme.options}


def with_scheme(config: ModelConfig, scheme: str) -> ModelConfig:
    """`config` as `scheme`: the options `scheme` reads are kept (`alpha` for keel), every other scheme's is
    cleared. How bench and the experiments turn one model into each scheme they compare."""
    if scheme not in SCHEMES:
        _fail("scheme", f"unknown scheme {scheme!r}", ", ".join(SCHEMES))
    options = {name: getattr(config, name) for name in SCHEME_OPTIONS}
    return replace(config, scheme=scheme, **SCHEMES[scheme].switched(options))


def _fail(field: str, problem: str, allowed: str) -> None:
    raise ValueError(f"ModelConfig.{field}: {problem}; allowed: {allowed}")


# The largest value of each size field: far beyond any model that fits a machine (the memory plan refuses those
# first), small enough that no count, shape or loop built from it overflows or runs for ever.
SIZE_LIMITS = {"vocab_size": 2**24, "d_model": 2**17, "n_blocks": 2**16, "n_heads": 2**12, "max_seq_len": 2**24,
               "n_kv_heads": 2**12, "d_ffn": 2**20}
# The largest value of each float field (each must also be > 0): past these no model trains (an init_std of 100, a
# norm_eps of 2), and far past them a product overflows float32. RoPE bases in use reach about 1e7.
FLOAT_LIMITS = {"rope_theta": 1e12, "norm_eps": 1.0, "init_std": 10.0}


def _validate(c: ModelConfig) -> None:
    for name, most in SIZE_LIMITS.items():
        value = getattr(c, name)
        default = ", or None for the default" if name in ("n_kv_heads", "d_ffn") else ""
        if not (default and value is None) and (isinstance(value, bool) or not isinstance(value, int)
                                                or not 1 <= value <= most):
            _fail(name, f"got {value!r}", f"an integer in [1, {most:,}]{default}")
    if c.d_model % c.n_heads:
        _fail("d_model", f"{c.d_model} is not divisible by n_heads={c.n_heads}", "a multiple of n_heads")
    if c.n_heads % c.kv_heads:
        _fail("n_kv_heads", f"n_heads={c.n_heads} is not a multiple of n_kv_heads={c.kv_heads}",
              "a divisor of n_heads")
    if c.head_dim % 2:
        _fail("d_model", f"head dimension d_model/n_heads={c.head_dim} is odd (RoPE rotates pairs)",
              "d_model/n_heads even")
    for name, most in FLOAT_LIMITS.items():
        value = getattr(c, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= most:
            _fail(name, f"got {value!r}", f"a number in (0, {most:g}]".replace("e+0", "e").replace("e+", "e"))
    if not isinstance(c.dropout, (int, float)) or not 0 <= c.dropout < 1:
        _fail("dropout", f"got {c.dropout!r}", "a number in [0, 1)")
    if c.ffn not in FFN_TYPES:
        _fail("ffn", f"unknown FFN type {c.ffn!r}", ", ".join(FFN_TYPES))
    if c.norm not in NORM_TYPES:
        _fail("norm", f"unknown norm {c.norm!r}", ", ".join(NORM_TYPES))
    if c.scheme not in SCHEMES:
        _fail("scheme", f"unknown scheme {c.scheme!r}", ", ".join(SCHEMES))

    scheme = SCHEMES[c.scheme]
    for name in SCHEME_OPTIONS:
        if name not in scheme.options and getattr(c, name) is not None:
            users = [s for s, cls in SCHEMES.items() if name in cls.options]
            _fail(name, f"is set but scheme {c.scheme!r} does not use it", f"only with scheme {users[0]!r}")
    scheme.check_options(**{name: getattr(c, name) for name in scheme.options})
    if c.loop_blocks is not None:
        _validate_loop(c, scheme(c.n_sublayers, **c.scheme_kwargs()))


def _validate_loop(c: ModelConfig, scheme) -> None:
    k = c.loop_blocks
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= c.n_blocks or c.n_blocks % k:
        _fail("loop_blocks", f"got {k!r} with n_blocks={c.n_blocks}", "a divisor of n_blocks, or None (no loop)")
    # a block's weights serve every pass, so its layout must be the same on every pass after the first (the
    # first may differ: Keel's first-layer rule, applied once); a scheme whose layout depends on depth fails
    kinds = ("attn", "ffn")
    for i in range(4 * k, c.n_sublayers):
        if scheme.spec(i, kinds[i % 2]) != scheme.spec(2 * k + i % (2 * k), kinds[i % 2]):
            _fail("loop_blocks", f"scheme {c.scheme!r} gives sub-layer {i} another layout than the same "
                  f"sub-layer of the second pass ({2 * k + i % (2 * k)})", "a scheme whose layout repeats (not mix_ln "
                  "with Post-LN blocks beyond the first pass), or None")


CONFIG_FIELDS = tuple(f.name for f in fields(ModelConfig))
