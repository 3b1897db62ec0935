"""The wide Pre-LN of Table 5, for downstream (results/deep-vs-wide/study.yaml declares the same arm)."""

from __future__ import annotations


def wide_model(cfg):
    """The wide Pre-LN of Table 5 (`wide_sublayers` at `wide_d_model`), for a config with the wide fields
    (downstream; results/deep-vs-wide/study.yaml declares the same arm)."""
    return cfg.point_model("pre_ln", cfg.wide_sublayers, d_model=cfg.wide_d_model, n_heads=cfg.wide_heads,
                           n_kv_heads=cfg.wide_kv_heads)
