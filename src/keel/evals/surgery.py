"""Looking inside a trained model, whose sub-layers compute `y = alpha * x + F` (then `norm_out(y)`): `removed(model,
i)` makes sub-layer i the identity, x' = x (norm_out and alpha gone too); `branches_off(model, [i])` zeroes its F
only, x' = norm_out(alpha * x) (Keel's stream renormalised as before, the branch's contribution gone);
`residual_sizes` gives rms(F), rms(alpha x) and rms(alpha x + F) per sub-layer, whose ratio rms(alpha x) / rms(alpha
x + F) scales the shortcut's LN Jacobian in the paper's Eq. 15/19 (1/sqrt(2) for Post-LN when |F| = |x|)."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


class Identity(nn.Module):
    """Stands in for a removed sub-layer: x' = x."""

    def forward(self, x, branch, *args):
        return x


class ZeroBranch(nn.Module):
    """Stands in for a switched-off branch: F(u) = 0."""

    def forward(self, u, *args, **kwargs):
        return torch.zeros_like(u)


def _slot(index: int) -> tuple[int, str]:
    return index // 2, "attn" if index % 2 == 0 else "ffn"


@contextmanager
def removed(model, index: int):
    """The model with sub-layer `index` replaced by the identity, restored after."""
    b, kind = _slot(index)
    saved = getattr(model.blocks[b], f"{kind}_res")
    setattr(model.blocks[b], f"{kind}_res", Identity())
    try:
        yield
    finally:
        setattr(model.blocks[b], f"{kind}_res", saved)


@contextmanager
def branches_off(model, indices):
    """The model with the branches F of the given sub-layers replaced by zero (norms and alpha kept)."""
    saved = []
    for i in indices:
        b, kind = _slot(i)
        saved.append((b, kind, getattr(model.blocks[b], kind)))
        setattr(model.blocks[b], kind, ZeroBranch())
    try:
        yield
    finally:
        for b, kind, module in saved:
            setattr(model.blocks[b], kind, module)


def plain(model):
    """`model` itself when eager with no fused junction, else such a twin with its weights: the probes here hook or
    swap single sub-layers, which a compiled block or a fused junction would hide."""
    from keel.model.transformer import TransformerLM  # noqa: PLC0415
    from keel.scale.fused_junction import fused_junctions  # noqa: PLC0415

    compiled = any(getattr(b, "_compiled_call_impl", None) is not None for b in model.blocks)
    if not compiled and not fused_junctions(model):
        return model
    twin = TransformerLM(model.config).to(next(model.parameters()).device)
    twin.load_state_dict(model.state_dict())
    return twin.train(model.training)


@torch.no_grad()
def residual_terms(model, x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sub-layer, on the batch `x`: the two terms of its residual sum, (alpha * x, F), in float32, F after
    norm_branch where the scheme has one. Needs a model without the fused junction (`plain`)."""
    seen: dict[int, dict] = {}
    hooks = []
    for s in model.sublayers():
        res = model.get_submodule(s.path)
        branch = getattr(model.blocks[s.block], s.kind)

        def pre(m, args, i=s.index):
            seen.setdefault(i, {})["x"] = args[0].float()

        def post(m, args, out, i=s.index):
            seen.setdefault(i, {})["f"] = out.float()
        hooks += [res.register_forward_pre_hook(pre), branch.register_forward_hook(post)]
    was_training = model.training
    model.eval()
    try:
        model(x.to(next(model.parameters()).device))
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    terms = []
    for s in model.sublayers():
        res = model.get_submodule(s.path)
        h = seen[s.index]["f"]
        if res.norm_branch is not None:  # Peri-LN normalises F before the sum
            h = res.norm_branch(h).float()
        terms.append((res.alpha * seen[s.index]["x"], h))
    return terms


def residual_sizes(model, x: torch.Tensor) -> dict[str, list[float]]:
    """Per sub-layer, on the batch `x`: rms of the branch output F, of the scaled shortcut alpha*x, and of
    their sum (before norm_out)."""
    terms = residual_terms(model, x)
    rms = lambda ts: [t.pow(2).mean().sqrt().item() for t in ts]
    return {"rms_f": rms(h for _, h in terms), "rms_ax": rms(ax for ax, _ in terms),
            "rms_sum": rms(ax + h for ax, h in terms)}
