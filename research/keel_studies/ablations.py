"""ablations: Keel's two free choices the paper does not measure, alpha and the first-layer rule.

Arms at one depth (default 32 sub-layers), each a Keel model differing in one field from the default
(alpha = L, first_layer = v2), plus Pre-LN as the reference: alpha in {L, sqrtL, `small_alpha`} and
first_layer in {v2, v1, none}. Method as in keel_studies.scaling: per arm the LR is chosen from `lrs`
with the first seed on the select half, the other seeds run at it, losses are reported on the report half
as mean ± SD, and the difference to the default arm is taken seed by seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from keel.experiments.budget import BudgetConfig, method_note, paired_gap, select_then_seeds
from keel.experiments.common import ExperimentConfig, markdown_table, pm, pyplot, save, tiny_quick, write_outputs


@dataclass
class AblationConfig(BudgetConfig):
    depth: int = 32
    lrs: list[float] = field(default_factory=lambda: [3e-3, 1e-2])
    small_alpha: float = 2.0
    references: list[str] = field(default_factory=lambda: ["pre_ln"])  # baseline schemes run beside the variants

    PER_POINT: ClassVar[dict[str, str]] = ExperimentConfig.PER_POINT | {
        "model.n_blocks": "depth", "model.scheme": "the arms (keel variants and references)",
        "model.alpha": "the arms", "model.first_layer": "the arms"}

    @classmethod
    def quick(cls) -> AblationConfig:
        return tiny_quick(cls, 6, depth=4, lrs=[3e-3], seeds=[0, 1], curve_every=0)

    def arms(self) -> dict:
        variants = {"keel (alpha=L, v2)": {}, "alpha=sqrtL": {"alpha": "sqrtL"},
                    f"alpha={self.small_alpha:g}": {"alpha": self.small_alpha},
                    "first_layer=v1": {"first_layer": "v1"}, "first_layer=none": {"first_layer": "none"}}
        arms = {label: self.point_model("keel", self.depth, **extra) for label, extra in variants.items()}
        for scheme in self.references:
            arms[scheme] = self.point_model(scheme, self.depth)
        return arms


def run(cfg: AblationConfig, out: Path, command: str) -> dict:
    arms = cfg.arms()
    keys = {label: label.replace(" ", "").replace("(", "").replace(")", "").replace(",", "-").replace("=", "")
            for label in arms}
    res = select_then_seeds(cfg, out, {keys[label]: m for label, m in arms.items()}, "ablations")
    base = res["arms"][keys["keel (alpha=L, v2)"]]
    rows = []
    for label, m in arms.items():
        a = res["arms"][keys[label]]
        gap = paired_gap(a, base)
        rows.append([label, f"{_alpha(m):g}" if m.scheme == "keel" else "1",
                     f"{a['lr']:g}", pm(a["report_losses"]), f"{gap[0]:+.3f} ± {gap[1]:.3f}",
                     f"{a['diverged_seeds']}/{len(cfg.seeds)}"])
    table = markdown_table(["arm", "alpha", "chosen LR", "report loss", "minus default Keel (paired)",
                            "diverged"], rows)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, label in enumerate(arms):
        a = res["arms"][keys[label]]
        ax.errorbar([i], [a["mean"]], yerr=[a["sd"]], marker="o", capsize=4, color=f"C{i}")
        ax.scatter([i] * len(a["report_losses"]), a["report_losses"], s=10, color=f"C{i}", alpha=0.5)
    ax.set_xticks(range(len(arms)), list(arms), rotation=20, fontsize=8)
    ax.set_ylabel("report-half loss (mean ± SD, dots = seeds)")
    ax.set_title(f"Keel ablations, {cfg.depth} sub-layers, d={cfg.model.d_model}", fontsize=10)
    save(fig, out, "ablations.png")
    write_outputs(out, "ablations", cfg, command, {**res, "labels": keys}, table, ["ablations.png"], method_note(cfg))
    return res


def _alpha(m) -> float:
    from keel.model.schemes import Keel, resolve_alpha

    return resolve_alpha(Keel.option("alpha", m.alpha), m.n_sublayers)
