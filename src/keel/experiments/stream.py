"""The stream-precision measurement: how much of each branch update survives a bf16 sum of the stream."""

from __future__ import annotations

import statistics

import torch

from keel.config import TrainConfig
from keel.evals.surgery import residual_terms
from keel.experiments.common import fixed_batches, markdown_table, pm, splits
from keel.model import Residual, TransformerLM


def to_bf16(t: torch.Tensor) -> torch.Tensor:
    """`t` rounded to bf16 (round to nearest even), kept in its own dtype; the gradient is rounded likewise."""
    return t.to(torch.bfloat16).to(t.dtype)


def round_stream(model: TransformerLM) -> list:
    """Give `model` a bf16 residual stream (returns the hooks): in every sub-layer the incoming stream, the shortcut
    sum (before norm_out) and the outgoing stream rounded to bf16, forward and (through the casts) backward; the rest
    as before. Bf16 rounding is the same on CPU and GPU, so this is a GPU's bf16 stream, only slower."""
    handles = []
    for m in (m for m in model.modules() if isinstance(m, Residual)):
        handles.append(m.register_forward_pre_hook(
            lambda mod, args: (to_bf16(args[0]), *args[1:]) if torch.is_tensor(args[0]) else None))
        if m.norm_out is not None:  # the sum alpha * x + F, before norm_out
            handles.append(m.norm_out.register_forward_pre_hook(lambda mod, args: (to_bf16(args[0]),)))
        handles.append(m.register_forward_hook(lambda mod, args, out: to_bf16(out) if torch.is_tensor(out) else None))
    return handles


def survival(ax: torch.Tensor, f: torch.Tensor) -> tuple[float, float]:
    """(share of F that survives the bf16 sum, relative error of the update), for one sub-layer's terms."""
    a = to_bf16(ax.double())
    d = to_bf16(a + to_bf16(f.double())) - a
    f = f.double()
    ff = f.pow(2).sum()
    if ff == 0:
        return float("nan"), float("nan")
    return float((d * f).sum() / ff), float((d - f).norm() / f.norm())


@torch.no_grad()
def survival_profile(model: TransformerLM, x: torch.Tensor) -> dict[str, list[float]]:
    """Per sub-layer: the surviving share, the relative error, and rms(F) / rms(alpha x)."""
    out = {"share": [], "rel_err": [], "f_over_ax": []}
    for ax, f in residual_terms(model, x):
        share, err = survival(ax, f)
        out["share"].append(share)
        out["rel_err"].append(err)
        out["f_over_ax"].append(float(f.pow(2).mean().sqrt() / ax.pow(2).mean().sqrt().clamp_min(1e-30)))
    return out


def init_point(config: TrainConfig) -> dict:
    """The profile of `config`'s model at its init (seeded by run.seed) on the first report-half batch."""
    run = config.run
    x = fixed_batches(splits(config.data)["report"], run.seq_len, run.batch_size, 1)[0][0]
    torch.manual_seed(run.seed)
    return survival_profile(TransformerLM(config.model), x)


def report(arms: dict[str, dict]) -> tuple[dict, str]:
    """(medians, markdown) of the arithmetic: per arm (`arms`: arm -> stream, sublayers, init: {sub-layers: profiles},
    trained: profiles) its init rows, then its trained one; medians over sub-layers 2.. (the first two are special in
    Keel v2), mean ± SD over seeds."""
    def median(values: list[float]) -> float:
        return statistics.median(finite) if (finite := [v for v in values if v == v]) else float("nan")
    rows, numbers = [], {}
    for arm, a in arms.items():
        states = [(d, "init", ps) for d, ps in a["init"].items()]
        for d, state, ps in [*states, (a["sublayers"], f"trained ({a['stream']} stream)", a["trained"])]:
            numbers[f"{arm}-{d}-{state.split()[0]}"] = shares = [median(p["share"][2:]) for p in ps]
            rows.append([arm, d, state, pm(shares), pm([median(p["rel_err"][2:]) for p in ps]),
                         pm([median(p["f_over_ax"][2:]) for p in ps], 5)])
    return numbers, markdown_table(["arm", "sub-layers", "state", "surviving share of F (median over sub-layers 2..)",
                                    "relative error of the update", "rms(F) / rms(alpha x)"], rows)
