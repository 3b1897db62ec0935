"""Residual/normalisation schemes: where the norms sit and how each sub-layer's sum is formed.

Every scheme is a specialisation of one general sub-layer update,

    x' = norm_out(alpha * x + norm_branch(F(norm_in(x))))

where F is the attention or FFN branch and each norm may be absent. A scheme decides, per sub-layer,
which norms exist and what alpha is (a `SublayerSpec`); `keel.model.transformer.Residual` is the one
module that carries the update out. Users pick a scheme by its string name and never combine norms by hand,
so an invalid placement cannot be expressed. Sub-layers are indexed 0..L-1 in order (attn, ffn, attn, ffn, ...),
L = n_sublayers = 2 * n_blocks, the paper's L.

Rules only, no torch: `ModelConfig` validates against this registry, and reading or checking a config must
not cost torch's import (seconds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

Kind = Literal["attn", "ffn"]


@dataclass(frozen=True)
class SublayerSpec:
    """Which norms one sub-layer has and its shortcut gain alpha."""

    norm_in: bool
    norm_out: bool
    alpha: float = 1.0
    norm_branch: bool = False


PRE = SublayerSpec(norm_in=True, norm_out=False)
POST = SublayerSpec(norm_in=False, norm_out=True)


class Scheme:
    """Base class. Subclasses state their equation and source in their docstring.

    A scheme owns its options (the ModelConfig fields only it reads): `defaults` says what an unset one (None)
    means, `shown` how one reads in `keel summary` and a model card, and `switched` what a config switched to
    another scheme keeps of them (keel.model.architecture.with_scheme)."""

    name: ClassVar[str]
    # config fields (beyond the shared ones) that this scheme reads; any other scheme rejects them
    options: ClassVar[tuple[str, ...]] = ()
    # what each option left unset (None) means
    defaults: ClassVar[dict[str, object]] = {}
    # whether the model applies a norm between the last sub-layer and the LM head
    final_norm: ClassVar[bool]
    # whether attention normalises Q, K and V after projection (HybridNorm)
    qkv_norm: ClassVar[bool] = False

    def __init__(self, n_sublayers: int):
        self.n_sublayers = n_sublayers

    @classmethod
    def check_options(cls, **values) -> None:
        """Raise a ValueError naming the field if one of this scheme's `options` (those set, not None) is
        invalid. Each scheme checks its own; ModelConfig calls this for the chosen scheme."""

    @classmethod
    def option(cls, name: str, value):
        """An option as the scheme uses it: `value`, or its default when unset (None)."""
        return cls.defaults.get(name) if value is None else value

    @classmethod
    def shown(cls, name: str, value, n_sublayers: int) -> str:
        """An option as `keel summary` and the model card show it: `v2 (default)`, `'v1'`, never None."""
        text = repr(value) if value is not None else str(cls.defaults.get(name))
        return text + (" (default)" if value is None else "")

    @classmethod
    def switched(cls, options: dict) -> dict:
        """Scheme options {name: value} of a config switched to this scheme: those this scheme reads are kept,
        every other is cleared (ModelConfig refuses an option its scheme does not read)."""
        return {name: (value if name in cls.options else None) for name, value in options.items()}

    def spec(self, index: int, kind: Kind) -> SublayerSpec:
        raise NotImplementedError

    def init_gain(self, index: int, kind: Kind, param: str) -> float:
        """Factor applied to a branch weight after the N(0, std^2) init (1 = unchanged)."""
        return 1.0


class PreLN(Scheme):
    """Pre-LN (paper Eq. 6; GPT-2/LLaMA): `x' = x + F(LN(x))`, with a final norm before the head."""

    name = "pre_ln"
    final_norm = True

    def spec(self, index, kind):
        return PRE


class PostLN(Scheme):
    """Post-LN (paper Eq. 3; Vaswani et al. 2017): `x' = LN(x + F(x))`. The last LN is the final norm."""

    name = "post_ln"
    final_norm = False

    def spec(self, index, kind):
        return POST


class DeepNorm(Scheme):
    """DeepNorm (paper Eq. 5; Wang et al. 2022, "DeepNet"): `x' = LN(a*x + F(x))`.

    Decoder-only constants from DeepNet's Table 1 with M = n_blocks decoder layers:
    a = (2M)^(1/4) = L^(1/4), and the FFN weights, the value projection and the output projection are
    initialised with gain b = (8M)^(-1/4) = (4L)^(-1/4); query and key keep gain 1.
    `deepnorm_beta="paper"` uses the constant the Keel paper quotes instead, b = L^(-1/4), which is
    sqrt(2) larger than DeepNet's (the two agree on a). DeepNet applies b to a Xavier init; here it
    scales the project's N(0, 0.02^2) init, as the Keel paper describes.
    """

    name = "deepnorm"
    options = ("deepnorm_beta",)
    defaults = {"deepnorm_beta": "deepnet"}
    final_norm = False
    scaled = ("wv.weight", "wo.weight")  # attention projections DeepNet scales; all FFN weights too

    betas = ("deepnet", "paper")

    @classmethod
    def check_options(cls, deepnorm_beta=None):
        if deepnorm_beta is not None and deepnorm_beta not in cls.betas:
            raise option_error("deepnorm_beta", f"got {deepnorm_beta!r}", ", ".join(cls.betas))

    def __init__(self, n_sublayers: int, deepnorm_beta: str | None = None):
        super().__init__(n_sublayers)
        self.a = n_sublayers**0.25
        beta = self.option("deepnorm_beta", deepnorm_beta)
        self.b = (4 * n_sublayers) ** -0.25 if beta == "deepnet" else n_sublayers**-0.25

    def spec(self, index, kind):
        return SublayerSpec(norm_in=False, norm_out=True, alpha=self.a)

    def init_gain(self, index, kind, param):
        return self.b if kind == "ffn" or param in self.scaled else 1.0


class MixLN(Scheme):
    """Mix-LN (Li et al. 2024): Post-LN `LN(x + F(x))` in the first floor(fraction * n_blocks) blocks,
    Pre-LN `x + F(LN(x))` above them, with a final norm. The split is counted in blocks, as Mix-LN's
    own paper counts layers, so a block's attention and FFN always share a scheme (default 25%).
    """

    name = "mix_ln"
    options = ("mix_ln_fraction",)
    defaults = {"mix_ln_fraction": 0.25}
    final_norm = True

    @classmethod
    def check_options(cls, mix_ln_fraction=None):
        if mix_ln_fraction is not None and not (
            isinstance(mix_ln_fraction, (int, float)) and not isinstance(mix_ln_fraction, bool)
            and 0 <= mix_ln_fraction <= 1
        ):
            raise option_error("mix_ln_fraction", f"got {mix_ln_fraction!r}", "a number in [0, 1]")

    def __init__(self, n_sublayers: int, mix_ln_fraction: float | None = None):
        super().__init__(n_sublayers)
        fraction = self.option("mix_ln_fraction", mix_ln_fraction)
        self.n_post_blocks = math.floor(fraction * (n_sublayers // 2))

    def spec(self, index, kind):
        return POST if index // 2 < self.n_post_blocks else PRE


class PeriLN(Scheme):
    """Peri-LN (Kim et al. 2025; the "sandwich" norm of Gemma 2/3, OLMo 2):
    `x' = x + LN_out(F(LN_in(x)))`, with a final norm before the head.
    """

    name = "peri_ln"
    final_norm = True

    def spec(self, index, kind):
        return SublayerSpec(norm_in=True, norm_out=False, norm_branch=True)


class HybridNorm(Scheme):
    """HybridNorm (Zhuo et al. 2025): QKV-normalised attention with no input norm,
    `y = x + Attn_QKVNorm(x)`, then a Post-Norm FFN, `x' = LN(y + FFN(y))`.

    Q, K and V are each RMS/Layer-normalised over their full projected width (OLMo 2's QK-norm
    placement, on which HybridNorm's code builds). The last FFN's LN is the final norm. The paper's
    HybridNorm* variant (Pre-Norm first block) is not implemented.
    """

    name = "hybrid_norm"
    final_norm = False
    qkv_norm = True

    def spec(self, index, kind):
        return SublayerSpec(norm_in=False, norm_out=False) if kind == "attn" else POST


class Keel(Scheme):
    """Keel (paper Eq. 16): `x' = LN_out(alpha*x + F(LN_in(x)))`, alpha a fixed scalar.

    alpha: "L" (default, the total number of sub-layers), "sqrtL", or a positive number.
    first_layer ("input layer initialisation"):
      - "v2" (default, arXiv v2): sub-layer 0 is `x + Attn(LN_in(x))` (no alpha, no LN_out);
        sub-layer 1 is `LN_out(x + FFN(LN_in(x)))` (no alpha); every later sub-layer is full Keel.
      - "v1" (arXiv v1): sub-layers 0 and 1 are plain Pre-LN `x + F(LN_in(x))`.
      - "none": every sub-layer is full Keel.
    No final norm: the stack already ends in LN_out.
    """

    name = "keel"
    options = ("alpha", "first_layer")
    defaults = {"alpha": "L", "first_layer": "v2"}
    final_norm = False
    alpha_modes = ("L", "sqrtL")
    max_alpha = 1e6  # past any depth's L (at most 131,072 sub-layers); alpha * x must stay far from float32's max
    first_layer_rules = ("v2", "v1", "none")

    @classmethod
    def check_options(cls, alpha=None, first_layer=None):
        if alpha is not None and alpha not in cls.alpha_modes:
            allowed = f'"L", "sqrtL", or a number in (0, {cls.max_alpha:g}]'.replace("e+0", "e").replace("e+", "e")
            try:
                value = float(alpha) if not isinstance(alpha, bool) else float("nan")
            except (TypeError, ValueError):
                value = float("nan")
            if not 0 < value <= cls.max_alpha:
                raise option_error("alpha", f"got {alpha!r}", allowed)
        if first_layer is not None and first_layer not in cls.first_layer_rules:
            raise option_error("first_layer", f"got {first_layer!r}", ", ".join(cls.first_layer_rules))

    def __init__(self, n_sublayers: int, alpha: float | str | None = None, first_layer: str | None = None):
        super().__init__(n_sublayers)
        self.alpha = resolve_alpha(self.option("alpha", alpha), n_sublayers)
        self.first_layer = self.option("first_layer", first_layer)

    @classmethod
    def shown(cls, name, value, n_sublayers):
        if name != "alpha":
            return super().shown(name, value, n_sublayers)
        mode = cls.option("alpha", value)  # "L", "sqrtL" or a number: shown with the number it is at this depth
        number = f"{resolve_alpha(mode, n_sublayers):g}"
        text = f"{mode} = {number}" if mode in cls.alpha_modes else number
        return text + (" (default)" if value is None else "")

    def spec(self, index, kind):
        keel = SublayerSpec(norm_in=True, norm_out=True, alpha=self.alpha)
        if self.first_layer == "v2" and index < 2:
            return SublayerSpec(norm_in=True, norm_out=index == 1)
        if self.first_layer == "v1" and index < 2:
            return PRE
        return keel


def option_error(field: str, problem: str, allowed: str) -> ValueError:
    return ValueError(f"ModelConfig.{field}: {problem}; allowed: {allowed}")


def resolve_alpha(alpha: float | str, n_sublayers: int) -> float:
    """Turn an alpha setting ("L", "sqrtL" or a number, also as a string) into a number."""
    if alpha == "L":
        return float(n_sublayers)
    if alpha == "sqrtL":
        return math.sqrt(n_sublayers)
    return float(alpha)


SCHEMES: dict[str, type[Scheme]] = {
    cls.name: cls for cls in (Keel, PreLN, PostLN, DeepNorm, MixLN, PeriLN, HybridNorm)
}
# every scheme-specific ModelConfig field, derived from the registry
SCHEME_OPTIONS: tuple[str, ...] = tuple(dict.fromkeys(o for cls in SCHEMES.values() for o in cls.options))
