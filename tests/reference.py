"""A naive, written-out forward pass for every scheme, sharing no code with `keel` but its weights.

Attention is an explicit masked softmax with repeated KV heads; RoPE rotates each (i, i + hd/2) pair
by an explicit angle; every scheme's update is its paper equation spelled out per sub-layer.
"""

import math

import torch


def rms(x, g, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * g


def layer_norm(x, g, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * g


def rope(x, theta):
    """x: (B, H, T, hd). Pair i rotates with i + hd/2 by angle t * theta^(-2i/hd)."""
    B, H, T, hd = x.shape
    out = torch.empty_like(x)
    for i in range(hd // 2):
        ang = torch.arange(T, dtype=torch.float64) * theta ** (-2 * i / hd)
        c, s = torch.cos(ang).to(x.dtype), torch.sin(ang).to(x.dtype)
        a, b = x[..., i], x[..., i + hd // 2]
        out[..., i] = a * c - b * s
        out[..., i + hd // 2] = b * c + a * s
    return out


def attention(x, W, cfg, p, qkv_norm):
    B, T, d = x.shape
    H, KV, hd = cfg.n_heads, cfg.kv_heads, cfg.d_model // cfg.n_heads
    q, k, v = x @ W[p + "wq.weight"].T, x @ W[p + "wk.weight"].T, x @ W[p + "wv.weight"].T
    if qkv_norm:
        q = NORM[cfg.norm](q, W[p + "q_norm.weight"], cfg.norm_eps)
        k = NORM[cfg.norm](k, W[p + "k_norm.weight"], cfg.norm_eps)
        v = NORM[cfg.norm](v, W[p + "v_norm.weight"], cfg.norm_eps)
    q = q.reshape(B, T, H, hd).permute(0, 2, 1, 3)
    k = k.reshape(B, T, KV, hd).permute(0, 2, 1, 3).repeat_interleave(H // KV, dim=1)
    v = v.reshape(B, T, KV, hd).permute(0, 2, 1, 3).repeat_interleave(H // KV, dim=1)
    q, k = rope(q, cfg.rope_theta), rope(k, cfg.rope_theta)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    y = torch.softmax(scores, dim=-1) @ v  # (B, H, T, hd)
    return y.permute(0, 2, 1, 3).reshape(B, T, H * hd) @ W[p + "wo.weight"].T


def ffn(x, W, cfg, p):
    if cfg.ffn == "swiglu":
        g = x @ W[p + "w_gate.weight"].T
        return (g * torch.sigmoid(g) * (x @ W[p + "w_up.weight"].T)) @ W[p + "w_down.weight"].T
    u = x @ W[p + "w_up.weight"].T
    return (0.5 * u * (1 + torch.erf(u / math.sqrt(2)))) @ W[p + "w_down.weight"].T


NORM = {"rmsnorm": rms, "layernorm": layer_norm}


def forward(model, idx):
    """Logits of `model` computed from its equations; `model` only supplies config and weights."""
    cfg = model.config
    W = {k: v.detach().double() for k, v in model.state_dict().items()}
    L, eps = 2 * cfg.n_blocks, cfg.norm_eps
    ln = NORM[cfg.norm]
    x = W["embed.weight"][idx]
    for i in range(L):
        b, kind = i // 2, ("attn" if i % 2 == 0 else "ffn")
        res = f"blocks.{b}.{kind}_res."

        def g(name):
            return W[res + name + ".weight"]

        def F(h):
            if kind == "attn":
                return attention(h, W, cfg, f"blocks.{b}.attn.", cfg.scheme == "hybrid_norm")
            return ffn(h, W, cfg, f"blocks.{b}.ffn.")

        s = cfg.scheme
        if s == "pre_ln":  # x + F(LN(x))
            x = x + F(ln(x, g("norm_in"), eps))
        elif s == "post_ln":  # LN(x + F(x))
            x = ln(x + F(x), g("norm_out"), eps)
        elif s == "deepnorm":  # LN(a x + F(x)), a = (2M)^(1/4) with M blocks
            x = ln((2 * cfg.n_blocks) ** 0.25 * x + F(x), g("norm_out"), eps)
        elif s == "mix_ln":  # Post-LN in the first floor(f * blocks) blocks, then Pre-LN
            frac = 0.25 if cfg.mix_ln_fraction is None else cfg.mix_ln_fraction
            if b < math.floor(frac * cfg.n_blocks):
                x = ln(x + F(x), g("norm_out"), eps)
            else:
                x = x + F(ln(x, g("norm_in"), eps))
        elif s == "peri_ln":  # x + LN_out(F(LN_in(x)))
            x = x + ln(F(ln(x, g("norm_in"), eps)), g("norm_branch"), eps)
        elif s == "hybrid_norm":  # attn: x + Attn_qkvnorm(x); ffn: LN(x + FFN(x))
            x = x + F(x) if kind == "attn" else ln(x + F(x), g("norm_out"), eps)
        elif s == "keel":  # LN_out(alpha x + F(LN_in(x))) with the first-layer rule
            alpha = {"L": L, "sqrtL": math.sqrt(L), None: L}.get(cfg.alpha, cfg.alpha)
            alpha = float(alpha)
            rule = cfg.first_layer or "v2"
            if rule == "v2" and i == 0:
                x = x + F(ln(x, g("norm_in"), eps))
            elif rule == "v2" and i == 1:
                x = ln(x + F(ln(x, g("norm_in"), eps)), g("norm_out"), eps)
            elif rule == "v1" and i < 2:
                x = x + F(ln(x, g("norm_in"), eps))
            else:
                x = ln(alpha * x + F(ln(x, g("norm_in"), eps)), g("norm_out"), eps)
        else:
            raise AssertionError(s)
    if s in ("pre_ln", "mix_ln", "peri_ln"):
        x = ln(x, W["final_norm.weight"], eps)
    return x @ W["lm_head.weight"].T
