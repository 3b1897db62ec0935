"""What the finished part of a sweep that is still running shows, by the experiment's own analysis; it trains
nothing and changes no point.

    python results/finished.py frontier     # -> results/frontier/finished.md

(The downstream sweep, which this also read while it ran, is complete: its own report is results/downstream/.)

frontier: rule 15 writes its verdicts only when all three depths are done. For the depths whose 36 runs are all
done this writes the numbers without a verdict: per scheme the chosen LR (mean select-half loss over the seeds),
the report losses, the class (learns / stuck / between), and Keel - X per depth with its paired t-test.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

from keel.experiments import frontier, stats
from keel.experiments.budget import unigram_level
from keel.experiments.common import markdown_table, pm
from keel.experiments.sweep import EXECUTION_FIELDS, _differences, upgrade_recorded

HERE = Path(__file__).resolve().parent


def load(name: str, cfg) -> dict | None:
    """The finished points of results/<name>, or None if they were run with another configuration (the sweep's
    own check: fields added since with their defaults, the seed list and EXECUTION_FIELDS may differ)."""
    recorded = upgrade_recorded(json.loads((HERE / name / "points" / "config.json").read_text()))
    mine = json.loads(json.dumps(asdict(cfg)))
    changed = [k for k in _differences(mine, recorded, mine) if k != "seeds" and k not in EXECUTION_FIELDS]
    if changed:
        print(f"results/{name}: its points were run with another configuration (differs in {', '.join(changed)})",
              file=sys.stderr)
        return None
    return {p.stem: json.loads(p.read_text()) for p in (HERE / name / "points").glob("*.json") if p.stem != "config"}


def frontier_depths() -> int:
    cfg = frontier.FrontierConfig()
    points = load("frontier", cfg)
    if points is None:
        return 2
    depths = [d for d in cfg.depths if all(frontier.key(s, d, lr, k) in points for s in cfg.schemes
                                           for lr in cfg.grid(s, d) for k in cfg.seeds)]
    unigram = unigram_level(cfg)
    rows, gaps = [], []
    for d in depths:
        arms = {}
        for s in cfg.schemes:
            lr = frontier.choose(cfg, points, s, d)
            losses = [points[frontier.key(s, d, lr, k)]["report_loss"] for k in cfg.seeds]
            arms[s] = losses
            ratio = [points[frontier.key(s, d, lr, k)].get("grad_bottom_over_top") for k in cfg.seeds]
            rows.append([d, s, f"{lr:g}", pm(losses), frontier.classify(losses, unigram, cfg),
                         f"{np.mean([r for r in ratio if r is not None]):.3g}"])
        gaps += [[d, f"keel - {x}", stats.describe(stats.paired(arms["keel"], arms[x]))]
                 for x in cfg.schemes if x != "keel"]
    total = sum(len(cfg.grid(s, d)) * len(cfg.seeds) for s in cfg.schemes for d in cfg.depths)
    text = (f"# frontier: the finished depths, no verdict yet\n\n{len(points)} of {total} points done; depths with "
            f"every run done: {depths}. Rule 15's verdicts are written only when all of {cfg.depths} are done; "
            f"these are its numbers so far, by its own method (LR per scheme and depth by the mean select-half loss "
            f"over seeds {cfg.seeds}; report loss on {cfg.run.eval_batches} report-half batches). Unigram level "
            f"{unigram:.3f} nats: learns = at least {cfg.learn_margin} below it in every seed, stuck = within "
            f"{cfg.stuck_margin} of it in every seed. Written by `python results/finished.py frontier`.\n\n"
            + markdown_table(["sub-layers", "scheme", "chosen LR", "report loss (mean ± SD, 3 seeds)", "class",
                              "grad bottom/top (mean)"], rows)
            + "\n\nPaired report-loss gaps (reported, no verdict):\n\n"
            + markdown_table(["sub-layers", "pair", "mean [95% CI], p"], gaps) + "\n")
    (HERE / "frontier" / "finished.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["frontier"]:
        print("usage: python results/finished.py frontier", file=sys.stderr)
        sys.exit(2)
    sys.exit(frontier_depths())
