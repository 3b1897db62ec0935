"""A declared study run (`run`), each cell whole in turn: its points, choices, tests and report."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np

from keel.config import TrainConfig
from keel.errors import ConfigError
from keel.experiments import common, downstream, maxlr, redundancy, stats, stream
from keel.experiments.budget import BudgetConfig, budget_point
from keel.experiments.grid import Grid, LadderGrid, _finite, grid_note, run_searches, search_grid
from keel.experiments.study_file import DeclaredStudy, _cell_name, _get, _leaves, _pinned, key, read, smoke
from keel.experiments.sweep import Sweep

__all__ = ["DeclaredStudy", "key", "point", "read", "run", "smoke"]  # the engine, as keel.cli calls it
MARGINAL_BELOW = 0.20


class _Grid(Grid):  # an integer field's: grows by whole numbers; a value the rounding repeats is a bound
    def beyond(self, edge: str, grown: int) -> float | None:
        value = super().beyond(edge, grown)
        value = None if value is None else int(round(value))
        return value if value and value not in self.values else None


def _label(side) -> str:
    return f"({_label(side[0])} - {_label(side[1])})" if isinstance(side, list) else side


def _at(side: str, cell_name: str) -> tuple[str, str]:  # "arm@cell" is at that cell, a plain arm at the test's
    arm, at, cell = side.partition("@")
    return arm, cell if at else cell_name


def _cell(study: DeclaredStudy, name: str) -> dict:
    return next(c for c in study.cells() if _cell_name(c) == name)


def point(study: DeclaredStudy, arm: str, cell: dict, hp: dict, seed: int) -> dict:
    """One point: the study's measurement at this arm, cell and tuned values."""
    c = study.config({**study.arms[arm], **cell, **hp})
    if study.measure in ("redundancy", "downstream"):  # one point per arm and seed, as trained
        return {"redundancy": redundancy, "downstream": downstream}[study.measure].point(
            common.point_config(c, c.model, seed))
    if study.measure == "max_lr":
        return maxlr.point(common.point_config(c, c.model, seed), *maxlr.settings(study.max_lr)) | {"arm": arm,
                                                                                                    "cell": cell}
    cfg = BudgetConfig(model=c.model, data=c.data, optim=c.optim, guard=c.guard, run=c.run,
                       curve_every=study.curve_every, curve_batches=study.curve_batches, probe=study.probe)
    extra = {"prepare": stream.round_stream if arm in study.stream["bf16"] else None, "extra": lambda model, report: {
        "survival": stream.survival_profile(model, report[0][0])}} if study.stream else {}  # on one report batch
    return budget_point(cfg, c.model, c.optim.lr, seed, **extra) | {"arm": arm, "cell": cell, "tuned": hp}


def _init_job(study: DeclaredStudy, arm: str, n_blocks: int, seed: int):
    c = study.config({**study.arms[arm], "model.n_blocks": n_blocks})
    return lambda: stream.init_point(common.point_config(c, c.model, seed))


def run(study: DeclaredStudy, out: Path, command: str, name: str = "study", question: str = "", rule: str = "") -> dict:
    """Every cell whole, one after the other (a partial sweep answers whole cells); then the tests and the report."""
    sweep, points, choices = Sweep(out, study), {}, {}
    base = study.config({})
    for cell in study.cells():
        desc = f"{name} {_cell_name(cell) or 'points'}"
        choices[_cell_name(cell)] = _tune_cell(study, sweep, cell, points, base, desc)
    if study.stream:  # each float32 arm's model at init, at every init_blocks
        points |= sweep.run({f"init-{key(a, {'model.n_blocks': n}, {}, s)}": _init_job(study, a, n, s)
                             for a in study.arms if a not in study.stream["bf16"]
                             for n in study.stream.get("init_blocks", []) for s in study.seeds}, f"{name} (init)")
    if study.measure == "max_lr":
        return _max_lr(study, out, command, name, points, choices, _asks(question, rule))
    if study.measure == "redundancy":
        return _redundancy(study, out, command, name, points, _asks(question, rule))
    if study.measure == "downstream":
        return _downstream(study, out, command, name, points, _asks(question, rule))
    picks = {c: {pick: _best_of(study, points, choices, c, among) for pick, among in study.best_of.items()
                 if not _pinned(study.best_of, pick)} for c in choices}
    if across := {pick: _best_of(study, points, choices, "", among) for pick, among in study.best_of.items()
                  if _pinned(study.best_of, pick)}:
        picks[""] = across  # a pick across cells (a study without axes has the one cell "", and no such pick)
    tests = _tests(study, points, choices, picks, study.seeds, study.compare)
    seeds = study.seeds
    if study.marginal_seeds and any(_marginal(t) for t in tests):
        seeds = [*study.seeds, *study.marginal_seeds]
        jobs = {}
        for t in tests:
            if _marginal(t):
                for arm, c in (_at(side, t["cell"]) for side in _leaves(t["arms"])):
                    hp, cell = choices[c][arm]["hp"], _cell(study, c)
                    jobs |= {key(arm, cell, hp, s): _job(study, arm, cell, hp, s) for s in study.marginal_seeds}
        points |= sweep.run(jobs, f"{name} (marginal seeds)")
        tests = _tests(study, points, choices, picks, seeds, study.compare)
    losses = {c: {arm: _losses(study, points, c, choice, arm, seeds) for arm in study.arms} for c, choice in
              choices.items()}  # per cell and arm, over `seeds`: what the tests compare
    results = {"points": points, "choices": choices, "tests": tests, "seeds": seeds, "report_losses": losses}
    if study.crossing:
        results["crossings"] = []
        for (c, choice), pair in itertools.product(choices.items(), study.compare):
            curves = [_curves(study, points, c, choice, arm, seeds) for arm in pair]
            (steps, a), (_, b) = curves
            none = [arm for arm, (_, curve) in zip(pair, curves) if not len(curve)]  # every seed of it diverged
            results["crossings"].append({"cell": c, "pair": pair, **({"no_curve": none} if none else stats.crossing(
                a, b, steps, study.crossing))})
    results |= ({"picks": picks} if study.best_of else {}) | ({"untested": _tests(
        study, points, choices, picks, seeds, study.untested, tested=False)} if study.untested else {})
    _report(study, out, command, name, results, question, rule)
    return results


def _job(study, arm, cell, hp, seed):
    return lambda: point(study, arm, cell, hp, seed)


def _tune_cell(study: DeclaredStudy, sweep: Sweep, cell: dict, points: dict, base: TrainConfig, desc: str) -> dict:
    fields = study.tuned()
    # a field a step leaves this arm at is its own; one its scheme has not (alpha: None) or a name ("L") is left out
    hp_of = lambda values: {f: v for f, v in zip(fields, values) if isinstance(v, int | float)}

    def score(arm: str, *values) -> float:
        runs = [points[key(arm, cell, hp_of(values), s)] for s in study.choosers()]
        return float(np.mean([_finite(r.get("select_loss")) for r in runs]))

    def search(arm: str):
        start = study.config({**study.arms[arm], **cell})
        now = {f: _get(start, f) for f in fields}
        steps = []
        for step in (s for s in study.tune if arm in s.get("arms", study.arms)):
            f, ties = step["field"], step.get("ties", "low")
            number = int if isinstance(_get(base, f), int) else float
            values, ok = [number(v) for v in step["grid"]], lambda v, f=f: _builds(study, {
                **study.arms[arm], **cell, **now, f: v})
            grid = LadderGrid(values, step["grow"], ties=ties, below=step.get("below", []), above=step.get(
                "above", []), allowed=ok) if {"below", "above"} & set(step) else (_Grid if number is int else Grid)(
                values, step["grow"], ties=ties, allowed=ok)
            now[f] = yield from search_grid(grid, lambda v, f=f: tuple({**now, f: v}[g] for g in fields),
                                            lambda *v, arm=arm: score(arm, *v))
            steps.append({"field": f, **grid.describe()})
        if not steps:  # nothing tuned for this arm: its point at the values it has
            yield [tuple(now[g] for g in fields)]
        return {"hp": hp_of(tuple(now[g] for g in fields)), "grids": steps}

    def run_round(asked: dict) -> set:
        jobs = {a: {key(a, cell, hp_of(v), s): _job(study, a, cell, hp_of(v), s) for v in hps
                    for s in study.choosers()} for a, hps in asked.items()}
        complete = lambda done: {a for a, arm in jobs.items() if arm.keys() <= done.keys()}
        got = sweep.run({k: j for arm in jobs.values() for k, j in arm.items()}, desc,
                        enough=lambda done: bool(complete(done)))
        points.update(got)
        return complete(got)
    chosen = run_searches({arm: search(arm) for arm in study.arms}, run_round)
    rest = [s for s in study.seeds if s not in study.choosers()]
    points |= sweep.run({key(a, cell, c["hp"], s): _job(study, a, cell, c["hp"], s) for a, c in chosen.items()
                         for s in rest}, f"{desc} (seeds at the choices)") if rest else {}
    return {arm: {"hp": c["hp"], "grids": c["grids"]} for arm, c in chosen.items()}


def _builds(study: DeclaredStudy, fields: dict) -> bool:  # whether a grown value is one the config takes
    try:
        study.config(fields)
        return True
    except ConfigError:
        return False


def _best_of(study: DeclaredStudy, points: dict, choices: dict, cell_name: str, among: list) -> dict:
    # the arm of `among` with the lowest mean select-half loss over the choosing seeds (ties: the first listed)
    select = {}
    for side in among:
        arm, c = _at(side, cell_name)
        select[side] = float(np.mean([_finite(points[key(arm, _cell(study, c), choices[c][arm]["hp"], s)].get(
            "select_loss")) for s in study.choosers()]))
    return {"arm": min(among, key=select.get), "select": select}


def _curves(study, points, cell_name, choice, arm, seeds) -> tuple[list[int], np.ndarray]:  # seeds not diverged
    runs = [points[key(arm, _cell(study, cell_name), choice[arm]["hp"], s)] for s in seeds]
    runs = [r for r in runs if not r["diverged"]]
    return runs[0]["evals"]["step"] if runs else [], np.array([r["evals"]["loss"] for r in runs])


def _marginal(t: dict) -> bool:
    p, ph = t["p"], t["p_holm"]
    return p is not None and ph is not None and ph >= stats.ALPHA and (p < stats.ALPHA or ph < MARGINAL_BELOW)


def _losses(study, points, cell_name, choice, arm, seeds, value: str = "report_loss") -> list:
    cell = _cell(study, cell_name)
    return [points[k][value] if (k := key(arm, cell, choice[arm]["hp"], s)) in points else None for s in seeds]


def _tests(study: DeclaredStudy, points: dict, choices: dict, picks: dict, seeds: list, pairs: list,
           tested: bool = True, value: str = "report_loss", better: str = "lower") -> list[dict]:
    # each pair per cell (one pinned to cells once, last; a best_of as its pick; a pair of pairs as its difference):
    # paired t-tests of `value`, Holm over all (`tested`; else mean and SD only), verdicts by `better`
    def side(a, cell_name: str):  # (the arms it names, as they resolve in the cell; its report losses per seed)
        if isinstance(a, list):
            (ra, la), (rb, lb) = side(a[0], cell_name), side(a[1], cell_name)
            return [ra, rb], [x - y if x is not None and y is not None else None for x, y in zip(la, lb)]
        arm, c = _at((picks.get(cell_name, {}).get(a) or picks.get("", {}).get(a) or {"arm": a})["arm"], cell_name)
        return arm if c == cell_name else f"{arm}@{c}", _losses(study, points, c, choices[c], arm, seeds, value)
    tests, across = [], [p for p in pairs if _pinned(study.best_of, _leaves(p)[0])]
    for cell_name, group in [*((c, [p for p in pairs if p not in across]) for c in choices), ("", across)]:
        for pair in group:
            (ra, la), (rb, lb) = side(pair[0], cell_name), side(pair[1], cell_name)
            arms = [ra, rb]
            t = stats.paired(la, lb)
            tests.append({"cell": cell_name, "pair": pair, "arms": arms, "seeds": [s for s, x, y in zip(seeds, la, lb)
                                                                                   if x is not None and y is not None],
                          **(t if tested else {k: t[k] for k in ("n", "mean", "sd")})})
    if not tested:
        return tests
    for t, adjusted in zip(tests, stats.holm([t["p"] for t in tests])):
        t["p_holm"] = adjusted
        t["verdict"] = "inconclusive" if adjusted is None or adjusted >= stats.ALPHA else (
            f"{_label(t['pair'][(t['mean'] < 0) != (better == 'lower')])} {better}")
    return tests


def _report(study: DeclaredStudy, out: Path, command: str, name: str, results: dict, question: str,
            rule: str = "") -> None:
    points, choices, seeds = results["points"], results["choices"], results["seeds"]
    rows = []
    for cell_name, choice in choices.items():
        for arm in study.arms:
            losses, cell = _losses(study, points, cell_name, choice, arm, seeds), _cell(study, cell_name)
            runs = [points.get(key(arm, cell, choice[arm]["hp"], s), {}) for s in seeds]
            diverged, size = sum(bool(r.get("diverged")) for r in runs), next((r["n_params"] for r in runs
                                                                               if r.get("n_params")), None)
            notes = "; ".join(f"{g['field']} from {', '.join(f'{v:g}' for v in g['values'])}{grid_note(g)}"
                              for g in choice[arm]["grids"])
            rows.append([cell_name or "-", arm, "-" if size is None else f"{size:,}",
                         ", ".join(f"{k}={v:g}" for k, v in choice[arm]["hp"].items()) or "-",
                         common.pm([x for x in losses if x is not None]) + (f", {diverged} diverged" if diverged
                                                                            else ""), notes or "-"])
    arms_table = common.markdown_table(["cell", "arm", "parameters", "chosen on the select half", "report-half loss",
                                        "grids"], rows)
    picked = [f"**{name}**{f' at {c}' if c else ''}: {p['arm']} (mean select-half loss at the choices: "
              + ", ".join(f"{a} {v:.3f}" for a, v in p["select"].items()) + ")"
              for c, cell_picks in results.get("picks", {}).items() for name, p in cell_picks.items()]
    tests_table = _tests_table(results, 4 if study.stream else 3)  # a bf16 stream's effect: thousandths
    if study.probe:
        tests_table += "\n\n" + _probe_table(study, results)
    if study.crossing:
        tests_table += "\n\n" + _crossing_table(results["crossings"])
    if study.stream:
        results["arithmetic"], table = stream.report(_profiles(study, results))
        tests_table += ("\n\nBf16 sums (keel.experiments.stream) on one report-half batch; 'init' is the paper's "
                        "N(0, 0.02^2) init.\n\n" + table)
    runs = [study.config(cell).run for cell in study.cells()]  # an axis may set the steps
    steps = ", ".join(dict.fromkeys(f"{r.steps:,}" for r in runs))
    tokens = ", ".join(dict.fromkeys(f"{r.steps * r.batch_size * r.seq_len:,}" for r in runs))
    rest = [s for s in study.seeds if s not in study.choosers()]
    notes = (f"Each point: the budget measurement (keel.experiments.budget) at {steps} steps of "
             f"{runs[0].batch_size}x{runs[0].seq_len} tokens ({tokens} tokens); "
             + (f"choices by the mean select-half loss over seeds {study.choosers()}" if study.tune or study.best_of
                else "no field tuned (each arm at the fields it sets)")
             + (f", seeds {rest} run at the choices" if rest else "")
             + f"; report-half losses on seeds {seeds}; paired two-sided t-tests, Holm over the study's "
             f"{len(results['tests'])} tests" + (f" ({len(results['untested'])} differences reported, not tested)"
                                                  if results.get("untested") else "") + ".")
    body = "\n\n".join([arms_table, *(["\n".join(f"- {p}" for p in picked)] if picked else []), tests_table])
    common.write_outputs(out, name, study, command, results, _asks(question, rule) + body, [_plot(study, out, results)],
                         notes)


def _asks(question: str, rule: str) -> str:  # a report's opening: the question and the rule's links
    links = ", ".join(f"[{r.rsplit('#', 1)[-1]}]({r})" if "#" in r or r.endswith(".md") else r
                      for r in (x.strip() for x in rule.split(",")) if r)
    return (f"**Question:** {question}\n\n" if question else "") + (f"**Rule:** {links}\n\n" if links else "")


def _tests_table(results: dict, d: int = 3) -> str:  # d: digits
    rows = [[t["cell"] or "-", " - ".join(_label(a) if a == r else f"{_label(a)} ({_label(r)})"
                                          for a, r in zip(t["pair"], t["arms"])),
             f"{t['mean']:+.{d}f} ± {t['sd']:.{d}f} (n={t['n']})" if t["sd"] is not None else
             stats.describe(t, d) if "p" in t else f"{t['mean']:+.{d}f} (n={t['n']})",
             "-" if t.get("ci95") is None else f"[{t['ci95'][0]:+.{d}f}, {t['ci95'][1]:+.{d}f}]",
             "-" if "p" not in t else "n/a" if t["p"] is None else f"{t['p']:.2g}",
             "-" if t.get("p_holm") is None else f"{t['p_holm']:.2g}", t.get("verdict", "reported, not tested")]
            for t in [*results["tests"], *results.get("untested", [])]]
    return common.markdown_table(["cell", "difference", "mean ± SD of the paired differences", "95% CI", "p", "Holm p",
                           "verdict"], rows)


def _max_lr(study: DeclaredStudy, out: Path, command: str, name: str, points: dict, choices: dict, asks: str) -> dict:
    # the verdicts (a cell and seed judged whole: stagnation compares its arms), the tests on the max LRs (or logs)
    every, rules = maxlr.settings(study.max_lr)
    verdicts = {}
    for cell in study.cells():
        configs = {arm: study.config({**fields, **cell}) for arm, fields in study.arms.items()}
        refs, peaks = maxlr.references(configs), {arm: c.optim.lr for arm, c in configs.items()}
        for s in study.seeds:
            judged = maxlr.judge({arm: points[key(arm, cell, {}, s)] for arm in study.arms}, refs, rules, peaks)
            verdicts |= {key(arm, cell, {}, s): v for arm, v in judged.items()}
    log = study.max_lr.get("scale") == "log"
    scored = {k: {"max_lr": (math.log(v["max_lr"]) if v["max_lr"] > 0 else None) if log else v["max_lr"]}
              for k, v in verdicts.items()}
    tests = _tests(study, scored, choices, {}, study.seeds, study.compare, value="max_lr", better="higher")
    cells = {_cell_name(c): {arm: [(points[k], verdicts[k]) for k in (key(arm, c, {}, s) for s in study.seeds)]
                             for arm in study.arms} for c in study.cells()}
    found, text, plots, notes = maxlr.report(cells, study.seeds, study.config({}), every, rules, _leaves(
        study.compare[0])[-1], study.max_lr.get("published", {}), out, name)
    results = {"points": points, "verdicts": verdicts, **found, "tests": tests, "seeds": study.seeds}
    notes += (f" Tests: paired two-sided t-tests on the {'log ' if log else ''}max LR, Holm over the study's "
              f"{len(tests)} tests.")
    common.write_outputs(out, name, study, command, results, asks + text + "\n\n" + _tests_table(results, 4), plots,
                         notes)
    return results


def _redundancy(study: DeclaredStudy, out: Path, command: str, name: str, points: dict, asks: str) -> dict:
    # each arm's deltas summarised over its seeds; the compare pairs' paired tests of ARM.MODE.PART
    arms = {arm: [points[key(arm, {}, {}, s)] for s in study.seeds] for arm in study.arms}
    summary, table = redundancy.report(arms)
    sides = {side: [p[side.rsplit(".", 1)[1]] for p in summary["-".join(side.rsplit(".", 2)[:2])]]
             for side in {s for p in study.compare for s in p}}
    scored = {key(side, {}, {}, s): {"delta": d} for side, ds in sides.items() for s, d in zip(study.seeds, ds)}
    tests = _tests(study, scored, {"": {side: {"hp": {}} for side in sides}}, {}, study.seeds, study.compare,
                   value="delta", better="higher")
    results = {"points": points, "summary": summary, "tests": tests, "seeds": study.seeds}
    notes = redundancy.notes([study.config(fields) for fields in study.arms.values()], study.seeds) + (
        f" Tests: paired two-sided t-tests over seeds, Holm over the study's {len(tests)} tests." if tests else "")
    text = asks + table + ("\n\n" + _tests_table(results, 4) if tests else "")
    common.write_outputs(out, name, study, command, results, text, [redundancy.plot(arms, out)], notes)
    return results


def _downstream(study: DeclaredStudy, out: Path, command: str, name: str, points: dict, asks: str) -> dict:
    # the equal-loss pairs (compare tested, untested not), the rankings of `rank`; a panel per group of arms
    runs = {arm: [points[key(arm, {}, {}, s)] for s in study.seeds] for arm in study.arms}
    found = downstream.analyse(runs, study.compare, study.untested, study.rank)
    table, notes = downstream.report(found, study.config({}), study.seeds)
    panels = [[a for a in study.arms if a in group] for group in _linked(study.compare)] + [study.rank]
    results = {"points": points, **found, "seeds": study.seeds}
    plots = [downstream.plot(runs, found, panels, study.config({}), out)]
    common.write_outputs(out, name, study, command, results, asks + table, plots, notes)
    return results


def _linked(pairs: list) -> list[set]:  # the arms of pairs that share an arm, together
    groups = []
    for pair in pairs:
        joined = [g for g in groups if g & set(pair)]
        groups = [g for g in groups if g not in joined] + [set(pair).union(*joined)]
    return groups


def _probe_table(study: DeclaredStudy, results: dict) -> str:
    rows = []
    for cell_name, choice in results["choices"].items():
        for arm in study.arms:
            runs = [results["points"].get(key(arm, _cell(study, cell_name), choice[arm]["hp"], s), {})
                    for s in results["seeds"]]
            if not (runs := [r for r in runs if r.get("probe")]):
                continue
            n, off = runs[0]["n_sublayers"], [r["probe"]["loss_branches_above_k_off"] for r in runs]
            rows.append([cell_name or "-", arm, n, common.pm([o["2"] - o[str(n)] for o in off]),
                         common.pm([o[str(n // 2)] - o[str(n)] for o in off]),
                         common.pm([sum(r["probe"]["f_over_ax"][2:]) / max(1, n - 2) for r in runs], 4)])
    return ("Effective-depth probe (report half, at the choices, every seed): the loss added when every branch above "
            "sub-layer k is switched off (norms and alpha kept), and the mean rms(F)/rms(alpha x) of sub-layers "
            "2..L-1.\n\n" + common.markdown_table(["cell", "arm", "sub-layers", "delta loss, only sub-layers 0-1 on",
                                             "delta loss, lower half on", "mean rms(F)/rms(alpha x)"], rows))


def _profiles(study: DeclaredStudy, results: dict) -> dict:
    # stream.report's input: per arm its stream, sub-layers, init profiles (float32 arms) and trained profiles
    points, seeds, out = results["points"], results["seeds"], {}
    for arm in study.arms:
        bf16 = arm in study.stream["bf16"]
        runs = [points[key(arm, {}, results["choices"][""][arm]["hp"], s)] for s in seeds]
        out[arm] = {"stream": "bfloat16" if bf16 else "float32", "sublayers": runs[0]["n_sublayers"],
                    "trained": [r["survival"] for r in runs if "survival" in r],
                    "init": {2 * n: [points[f"init-{key(arm, {'model.n_blocks': n}, {}, s)}"] for s in seeds]
                             for n in ([] if bf16 else study.stream.get("init_blocks", []))}}
    return out


def _crossing_table(crossings: list[dict]) -> str:
    rows = [[c["cell"] or "-", f"{c['pair'][0]} vs {c['pair'][1]}", *(["-", f"no curve: every seed of "
                                                                        f"{' and '.join(c['no_curve'])} diverged",
                                                                        "-", "-", "-"] if c.get("no_curve") else [
             c["early_step"] + 1, f"{c['early_diff']:+.3f} (tol {c['early_tol']:.3f})", c["starts_slower"],
             "never" if c["cross_step"] is None else c["cross_step"] + 1,
             f"{c['final_diff']:+.3f} (tol {c['final_tol']:.3f})"])] for c in crossings]
    return ("The curves (report half, seed means; tol: the larger seed SD of the two): the first arm against the "
            "second at the first evaluation past the study's crossing fraction, the step from which it stays below, "
            "and at the end.\n\n" + common.markdown_table(["cell", "comparison", "early step", "difference, early",
                                                     "starts slower", "crosses for good at step", "difference, final"],
                                                    rows))


def _plot(study: DeclaredStudy, out: Path, results: dict) -> str:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    cells = list(results["choices"])
    for arm in study.arms:
        losses = [_losses(study, results["points"], c, results["choices"][c], arm, results["seeds"]) for c in cells]
        means = [float(np.mean([x for x in ls if x is not None])) if any(x is not None for x in ls) else math.nan
                 for ls in losses]
        ax.plot(range(len(cells)), means, marker="o", label=arm)
    ax.set_xticks(range(len(cells)), [c or "-" for c in cells], rotation=30, ha="right")
    ax.set_ylabel("report-half loss (mean over seeds)")
    ax.legend()
    return common.save(fig, out, "study.png")
