"""depth-sweep's report: report.md, results.json and the plot for the depths done so far; the per-depth table, the
tests in depth order and the one-minute "which scheme wins" table."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path

from keel.experiments import stats
from keel.experiments.common import markdown_table, mean_sd, pm, pyplot, save, write_outputs
from keel.experiments.grid import grid_note
from keel_studies.common import tokens
from keel_studies.depth_sweep import MARGINAL_BELOW, NAMES, REF, DepthSweepConfig

COLLAPSE_NATS = 0.1  # a report loss this close to the unigram level (or above it) is marked: max-lr's collapse margin


def _name(scheme: str) -> str:
    return NAMES.get(scheme, scheme)


def _choice_cells(cfg: DepthSweepConfig, depth: int, arm: dict) -> tuple[str, str]:
    """The chosen LR and warm-up with their grids' growth (and start, at a depth of lrs_from_previous), for the
    per-depth table."""
    since = (f"; grid from {', '.join(f'{v:g}' for v in arm['lr_start'])}"
             if depth in cfg.lrs_from_previous and "lr_start" in arm else "")
    lr = f"{arm['lr']:g}{since}" + grid_note(arm["lr_grid"])
    if "warmup_grid" not in arm:
        return lr, f"{arm['warmup']}"
    wu = f"{arm['warmup']} (chosen at LR {arm['warmup_chosen_at_lr']:g}{grid_note(arm['warmup_grid'])})"
    if "lr_grid_again" in arm:
        lr = (f"{arm['lr']:g} (chosen again at warm-up {arm['warmup']}{grid_note(arm['lr_grid_again'])}; first "
              f"{arm['warmup_chosen_at_lr']:g} at warm-up {cfg.optim.warmup_steps}{grid_note(arm['lr_grid'])})"
              + since.replace("; grid from", "; both grids from"))
    return lr, wu + "; one round of coordinate search"


def summary_rows(cfg: DepthSweepConfig, res: dict) -> list[list]:
    """Per depth (ascending): the scheme with the lowest mean report loss (seeds `cfg.seeds`), its gap to each
    other scheme over those seeds (the test's paired mean where one of the two is Keel, else the difference of the
    means) and the adjusted p; a test run again on more seeds adds its mean on them."""
    tests, rows = {t["id"]: t for t in res["tests"]}, []
    for d, arms in sorted(res["arms"].items(), key=lambda kv: int(kv[0])):
        means = {s: mean_sd(a["report_losses"])[0] for s, a in arms.items() if a["trains"]}
        if not means:
            rows.append([d, "no scheme trains", *["-" for _ in cfg.schemes]])
            continue
        win = min(means, key=means.get)
        cells = []
        for s in cfg.schemes:
            t = tests.get(f"{s}@{d}") if win == REF else tests.get(f"{win}@{d}") if s == REF else None
            if s == win:
                cells.append("-")
            elif not arms[s]["trains"]:
                cells.append("does not train")
            elif t is not None and t["test"] is not None:
                sign = 1 if win == REF else -1
                gap = t.get("test_first", t["test"])["mean"] * sign  # over cfg.seeds, as the winner was picked
                p = "n/a" if t["p_holm"] is None else f"{t['p_holm']:.2g}"
                more = f": {t['test']['mean'] * sign:+.3f}" if "test_first" in t else ""
                cells.append(f"{gap:+.3f} (Holm p={p}, n={t['test']['n']}{more})")
            else:
                cells.append(f"{means[win] - means[s]:+.3f} (not tested)")
        rows.append([d, f"{_name(win)} ({means[win]:.3f})", *cells])
    return rows


def write_report(cfg: DepthSweepConfig, out: Path, command: str, points: dict, res: dict) -> None:
    """report.md, results.json and the plot for the depths done so far, each file replaced whole (two processes
    write the same report when they finish a depth together)."""
    rows = []
    for d in sorted(res["arms"], key=int):
        for s, arm in res["arms"][d].items():
            lr, wu = _choice_cells(cfg, int(d), arm)
            extra = {k: v for k, v in arm["report_by_seed"].items() if k in cfg.marginal_seeds}
            loss = pm(arm["report_losses"]) + (f"; seeds {cfg.seeds + list(extra)}: "
                                               f"{pm(list(arm['report_by_seed'].values()))}" if extra else "")
            loss += _collapsed_note(arm["report_by_seed"], res["unigram"])
            rows.append([d, _name(s), lr, wu, loss if arm["trains"] else "does not train",
                         ", ".join(f"{hp}: {v:.3f}" for hp, v in arm["select_by_hp"].items()),
                         f"{arm['core_seconds'] / 3600:.2f}"])
    status = res["status"]
    every = f"every depth of {cfg.depths} is in; Holm over the {res['family_size']} tests run."
    banner = (f"**FINAL**: {every}" if status == "final" else
              f"**INTERIM**: {every}" if set(res["depths_done"]) == set(cfg.depths) else
              f"**INTERIM**: depths {res['depths_done']} of {cfg.depths} are in; the verdicts below adjust over the "
              f"{res['family_size']} tests run so far and can change when later tests join the family.") \
        + _pending_note(cfg, res)
    table = banner + "\n\n" + markdown_table(
        ["sub-layers", "scheme", "chosen LR", "warm-up", "report loss (mean ± SD over seeds)",
         "mean select loss per LR@warm-up", "core-hours"], rows)
    vrows = [[t["what"], f"{len(t['seeds'])}" + (f" (marginal on {len(cfg.seeds)}: "
                                                 f"{stats.describe(t['test_first'])})" if t["extended"] else ""),
              stats.describe(t["test"]) if t["test"] else "no t-test",
              "n/a" if t["p_holm"] is None else f"{t['p_holm']:.2g}", t["verdict"],
              f"{status}: marginal, seeds {cfg.marginal_seeds} running" if t["id"] in res.get("pending", ())
              else status]
             for t in sorted(res["tests"], key=_test_order)]
    verdicts = markdown_table(["test (report loss, paired over seeds)", "seeds", "mean [95% CI], raw p",
                               "Holm p", "verdict", "interim or final"], vrows)
    minute = markdown_table(["sub-layers", "lowest mean report loss", *[f"gap to {_name(s)}" for s in cfg.schemes]],
                            summary_rows(cfg, res))
    below, above = cfg.warmup_ladders()
    notes = (f"{', '.join(_name(s) for s in cfg.schemes)} at {cfg.depths} sub-layers (in that order), d="
             f"{cfg.model.d_model}, {cfg.run.steps} steps x {cfg.run.batch_size}x{cfg.run.seq_len} = {tokens(cfg):,} "
             f"tokens, warm-up {cfg.optim.warmup_steps} then cosine. LR per (scheme, depth) from {cfg.lrs}"
             f"{_from_previous(cfg)}, grown past an edge choice up to {cfg.max_extensions} values per side, chosen by "
             f"the mean select-half loss over seeds {cfg.seeds} (a diverged seed counts as +inf; equal scores go to "
             f"the lower LR and the longer warm-up). {_name(cfg.warmup_scheme)}'s warm-up from "
             f"{cfg.warmups} at its chosen LR (grown through {below} / {above}), then its LR again at a new warm-up. "
             f"Report loss on {cfg.run.eval_batches} report-half batches. Unigram level {res['unigram']:.3f} nats. "
             f"Cost so far: {res['core_hours']:.1f} core-hours (sum of point times, one thread each).\n\n"
             f"Tests: Keel - X per depth and the per-seed least-squares slope of Keel - Pre-LN over log2(sub-layers) "
             f"against 0 (negative: Keel's lead grows with depth); Holm over the tests run; \"Keel better\" / \"Keel "
             f"worse\" at adjusted p < {stats.ALPHA}. A marginal test (raw p < {stats.ALPHA} with adjusted p >= "
             f"{stats.ALPHA}, or adjusted p in [{stats.ALPHA}, {MARGINAL_BELOW})) is run again with seeds "
             f"{cfg.marginal_seeds} added to both arms at their chosen hyper-parameters.\n\n{verdicts}\n\n"
             f"At this scale, in one minute ({status}; each depth's lowest mean report loss over seeds {cfg.seeds}, "
             f"its gap to every other scheme and the adjusted p of the test between them):\n\n{minute}")
    results = {"points": points, **res}
    tmp = Path(tempfile.mkdtemp(prefix=".report.tmp-", dir=out))
    try:
        write_outputs(tmp, "depth-sweep", cfg, command, results, table, [_plot(cfg, res, tmp)], notes)
        for f in tmp.iterdir():
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _from_previous(cfg: DepthSweepConfig) -> str:
    at = [d for d in cfg.depths if d in cfg.lrs_from_previous]
    return (f" (at {', '.join(map(str, at))} sub-layers: from the arm's choice at the depth run before and its two "
            f"neighbours on that grid, a start fixed before any run there)" if at else "")


def _pending_note(cfg: DepthSweepConfig, res: dict) -> str:
    """The marginal tests (keel_studies.depth_sweep.marginal) whose added seeds are running while this report
    stands."""
    if not res.get("pending"):
        return ""
    what = {t["id"]: t["what"] for t in res["tests"]}
    names = "; ".join(what[tid] for tid in sorted(res["pending"], key=lambda tid: _test_order({"id": tid})))
    return (f" Marginal on seeds {cfg.seeds}, so running again with seeds {cfg.marginal_seeds} added to both arms: "
            f"{names}. Their rows below are on seeds {cfg.seeds} until those runs are in.")


def _test_order(test: dict) -> float:
    """Tests by depth (ascending; a depth's tests keep their order), the growth slope last."""
    return math.inf if test["id"] == "slope" else int(test["id"].split("@")[1])


def _collapsed_note(by_seed: dict, unigram: float) -> str:
    # such an arm "trains" by the rule (no seed diverged) yet learned nothing: say so beside its loss
    low = [s for s, v in by_seed.items() if v is not None and v >= unigram - COLLAPSE_NATS]
    return f"; {len(low)} of {len(by_seed)} seeds within {COLLAPSE_NATS} nats of the unigram level" if low else ""


def _plot(cfg: DepthSweepConfig, res: dict, out: Path) -> str:
    """Left: each scheme's report loss per depth. Right: each Keel - X test with its 95% interval, filled where the
    Holm-adjusted p is below 0.05 (the table's verdicts), so the gaps the table reports are readable at a glance."""
    plt = pyplot()
    fig, (ax, dx) = plt.subplots(1, 2, figsize=(10, 4))
    depths = sorted(res["arms"])
    for i, s in enumerate(cfg.schemes):
        got = [(d, mean_sd(res["arms"][d][s]["report_losses"])) for d in depths if res["arms"][d][s]["trains"]]
        ax.errorbar([d for d, _ in got], [m for _, (m, _) in got], yerr=[sd for _, (_, sd) in got], marker="o",
                    color=f"C{i}", capsize=3, label=_name(s))
    # the unigram level (~3.3 nats) sits far above every trained arm: drawn only when an arm comes near it
    if ax.get_ylim()[1] >= res["unigram"] - COLLAPSE_NATS:
        ax.axhline(res["unigram"], color="grey", ls="--", lw=0.8, label="unigram level")
    ax.set_ylabel(f"report loss (unigram level {res['unigram']:.3f})")
    ax.set_title(f"mean ± SD over seeds {cfg.seeds}", fontsize=9)
    ax.legend(fontsize=8)
    others = [(i, s) for i, s in enumerate(cfg.schemes) if s != REF]  # colours as in the left panel
    for k, (i, s) in enumerate(others):
        rows = [(int(t["id"].split("@")[1]), t) for t in res["tests"] if t["id"].split("@")[0] == s and t["test"]]
        for d, t in rows:
            mean, ci = t["test"]["mean"], t["test"]["ci95"]  # no interval from a single seed
            yerr = [[mean - ci[0]], [ci[1] - mean]] if ci else None
            dx.errorbar([d * 1.06 ** (k - 1)], [mean], yerr=yerr, marker="o", color=f"C{i}", capsize=3,
                        mfc=f"C{i}" if t["verdict"] != "inconclusive" else "white",
                        label=f"Keel - {_name(s)}" if d == rows[0][0] else None)
    dx.axhline(0, color="grey", lw=0.8)
    dx.set_ylabel("Keel - X in report loss (below 0: Keel better)")
    dx.set_title("paired over seeds (5 where the table says), 95% interval; filled: Holm p < 0.05", fontsize=9)
    dx.legend(fontsize=8)
    for a in (ax, dx):
        a.set_xscale("log", base=2)
        a.set_xticks(depths, [str(d) for d in depths])
        a.set_xlabel("sub-layers")
    fig.suptitle(f"depth sweep at {tokens(cfg):,} tokens ({res['status']})", fontsize=10)
    fig.tight_layout()
    return save(fig, out, "depth-sweep.png")
