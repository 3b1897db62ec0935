"""Keel's junction norms on one GPU, in one command of under 8 minutes: the chained norms against the one-pass pair
(keel.kernels.norm_pair, the default), each with Inductor's mix-order reduction on (torch's default) and off, and
Pre-LN beside them, at 8 x 4096 = 32,768 tokens a step, 64 sub-layers, activation checkpointing every block,
compiled default (the junction fused across blocks).

    python3 benchmarks/gpu/norm_window.py OUT [--seconds 460] [--toy]
    python3 benchmarks/gpu/norm_window.py --plan      # each part's PREDICTED time beside its box

Inductor reads `TORCHINDUCTOR_MIX_ORDER_REDUCTION` (torch._inductor.config.triton.mix_order_reduction) when it is
imported, and so do its compile workers, so each setting has a worker process of its own, started with the variable
set; this process only drives them (it never touches the device). Parts, each within its time box plus what the
parts before it left:

1. `build`: each worker builds and compiles Keel chained (`parallelize(one_pass_norms=False)`), Keel one-pass and
   Pre-LN at d=1024, two warm-up steps each, the first compiling from the caches the worker finds (cold on a fresh
   machine); all six models stay on the device (an estimated 45 GB of weights and AdamW state);
2. `rounds`: every model takes one untimed step, then `steps` timed ones, the order reversed every round, each
   worker handing its cached memory back after its turn so the next has room: medians, and Keel / Pre-LN with the
   Pre-LN of the same worker;
3. `profile`: each model's kernels by name under torch.profiler (kernel_profile.profile_steps), with the compiled
   reductions counted by what their names say they fuse: RMSNorm forwards, RMSNorm backwards, other sums;
4. `d2048`: two d=2048 models fit an 80 GB card at once, three do not, so the one-pass Keel (mix-order on) stays
   on the device while its partner changes: the chained Keel, then Pre-LN, then the one-pass Keel under mix-order
   off, `rounds` rounds each; the chained Keel's ratio to Pre-LN is the product of two measured ratios.

OUT/norm_window.json and OUT/norm_window.md are rewritten after every reply, so a part cut off by its box or the
command's limit keeps what it measured; each worker's log goes to OUT/worker-<setting>.log. `--toy` runs every part
at CPU-test size (tests/test_gpu_window.py). The plan (`plan()`, benchmarks/gpu/README.md) sizes the rounds from
the calibrated performance model's PREDICTED step times.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

from keel.launch import launcher_environment

if __name__ == "__main__":  # before torch loads, in the driver and in each worker (keel.launch)
    launcher_environment()

import torch  # noqa: E402
from campaign import VARIANTS, GpuSuite, freeze_imports  # noqa: E402

MIX_ENV = "TORCHINDUCTOR_MIX_ORDER_REDUCTION"
SETTINGS = {"mix_on": "1", "mix_off": "0"}  # worker -> the variable's value (1: torch's default outside fbcode)
ROUNDS, STEPS = 5, 3  # d=1024: rounds, timed steps per model per round (after one untimed step)
ROUNDS_2048, STEPS_2048 = 3, 2  # d=2048: per partner
# --toy: the fewest that still reverse the order between rounds and time more than one step (each round is every
# model's steps on a CPU)
TOY_ROUNDS, TOY_STEPS = 2, 2
WARMUP, PROFILE_STEPS = 2, 2
TOY_PROFILE_STEPS = 1  # --toy: each model's kernels by name over one profiled step (and one for its phases)
# seconds; the parts run in this order, each box plus what earlier parts left; with SLACK for starting and ending,
# within the 8 minutes a command is given
BOXES = {"build": 170, "rounds": 70, "profile": 60, "d2048": 150}
SLACK = 10
PROFILE_S = 5.0  # assumed seconds to collect and sum a profiled step's kernel table, per model


@dataclass(frozen=True)
class Model:
    scheme: str
    junction: str  # "one_pass" or "chained" (Keel's junction norms); "-" for Pre-LN
    setting: str  # the worker, by its Inductor setting

    @property
    def key(self) -> str:
        return f"{self.scheme}:{self.junction}:{self.setting}" if self.scheme == "keel" else f"pre_ln:{self.setting}"


KINDS = (("keel", "one_pass"), ("keel", "chained"), ("pre_ln", "-"))
MODELS_1024 = [Model(scheme, junction, w) for w in SETTINGS for scheme, junction in KINDS]
HELD_2048 = Model("keel", "one_pass", "mix_on")
PARTNERS_2048 = [Model("keel", "chained", "mix_on"), Model("pre_ln", "-", "mix_on"),
                 Model("keel", "one_pass", "mix_off")]


def shapes(toy: bool) -> dict[int, tuple[GpuSuite, int, int]]:
    """d=1024 and d=2048 (toy: 32 and 64): the suite, sub-layers and batch of the tokens point of each."""
    base = GpuSuite.toy() if toy else GpuSuite()
    n, batch = base.tokens_points[0]
    return {1024: (base, n, batch), 2048: (replace(base, d_model=2 * base.d_model), n, batch)}


# ---- the worker: one per Inductor setting, building and stepping models as the driver's commands say ----

@contextlib.contextmanager
def junction_norms(one_pass: bool):
    """Models built inside compose the compiler's junction norms as one op (`one_pass`, the default) or chained:
    `parallelize(one_pass_norms=...)`, which keel.train.step.build_model (Bench's path) does not pass on."""
    import keel.train.step as step  # noqa: PLC0415

    plain = step.parallelize
    step.parallelize = functools.partial(plain, one_pass_norms=one_pass)
    try:
        yield
    finally:
        step.parallelize = plain


def norm_pairs(model: torch.nn.Module) -> dict[str, int]:
    """How many of the model's junction norm pairs run in one pass and how many chained (what the arm installed)."""
    from keel.scale.fused_junction import NormPair  # noqa: PLC0415

    pairs = [obj.one_pass for m in model.modules()
             for obj in (getattr(m, "incoming", None), getattr(getattr(m, "junction", None), "pair", None))
             if isinstance(obj, NormPair)]
    return {"one_pass": sum(pairs), "chained": len(pairs) - sum(pairs)}


def worker(toy: bool) -> None:
    """Answer the driver's commands (one JSON line each on stdin) with one JSON line each; everything else this
    process prints goes to stderr."""
    from torch._inductor import config as inductor_config  # noqa: PLC0415

    from keel.bench.core import Bench, compile_counts, free, fresh_compile_state, scheme_config  # noqa: PLC0415
    from keel.runtime import machine  # noqa: PLC0415

    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints (Inductor's, a library's) must not break the replies
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    benches = {}

    def reply(obj: dict) -> None:
        replies.write(json.dumps(obj, default=str) + "\n")
        replies.flush()

    def release() -> None:
        free(device)  # cached blocks back to the device, so the other worker's step has room

    def build(cmd):
        suite, n, batch = shapes(toy)[cmd["d"]]
        compile, fused = VARIANTS["compiled+composed"]
        run = suite.run(ac_every=1, compile=compile, fused_junction=fused, batch_size=batch)
        before, start = compile_counts()["graphs"], time.monotonic()
        with junction_norms(cmd["junction"] != "chained"):
            b = Bench(scheme_config(suite.model(n), cmd["scheme"]), run, **suite.bench_options(device))
        row = {"build_s": time.monotonic() - start, "warmup_s": []}
        for _ in range(cmd["warmup"]):
            start = time.monotonic()
            b.step(record=False)
            row["warmup_s"].append(time.monotonic() - start)
        benches[cmd["key"]] = b
        release()
        return row | {"graphs": compile_counts()["graphs"] - before, "norm_pairs": norm_pairs(b.model),
                      "fused_junctions": b.fused, "n_params": sum(p.numel() for p in b.model.parameters()),
                      "d_model": b.config.d_model, "n_sublayers": b.config.n_sublayers, "batch_size": batch,
                      "seq_len": run.seq_len}

    def steps(cmd):
        b = benches[cmd["key"]]
        b.times.clear()
        b.peak = None
        b.step(record=False)  # after the other worker's turn: allocator and caches refilled, untimed
        for _ in range(cmd["n"]):
            b.step()
        release()
        return {"times_s": list(b.times), "peak_memory_bytes": b.peak}

    def profile(cmd):
        from kernel_profile import profile_steps  # noqa: PLC0415

        b = benches[cmd["key"]]
        b.step(record=False)
        result = profile_steps(b, cmd["n"])
        release()
        return result | {"counts": reduction_counts(result["by_name"])}

    def drop(cmd):
        benches.pop(cmd["key"], None)
        release()
        return {"freed": cmd["key"]}

    def reset(cmd):  # every model freed: their compiled graphs go too, keeping the next ones inside Dynamo's limit
        benches.clear()
        fresh_compile_state()
        release()
        return {"reset": True}

    ops = {"build": build, "steps": steps, "profile": profile, "free": drop, "reset": reset}
    if toy:
        # release() collects in full after every command: at toy size, walking what the imports made (about 400,000
        # objects) was a third of the window's CPU time; frozen out, each collection walks the models' own objects
        freeze_imports()
    reply({"machine": machine(device), "env": os.environ.get(MIX_ENV),
           "mix_order_reduction": getattr(inductor_config.triton, "mix_order_reduction", "not in this torch")})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        try:
            answer = ops[cmd["op"]](cmd)
        except Exception as err:  # out of memory, a compile error: answered, the driver goes on
            answer = {"error": traceback.format_exc()[-1500:],
                      "out_of_memory": isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err)}
        if "error" in answer:  # after the except block, whose traceback held the failed step's tensors
            release()
        reply(answer)


def reduction_counts(by_name: dict) -> dict[str, float]:
    """Per step, from the names of Inductor's Triton kernels (which list the ops each fuses): its reductions; those
    of RMSNorm's forward (rsqrt or mean, no sum: the forward and its checkpointed recompute); RMSNorm's backward
    (rsqrt or mean, and a sum: the input gradient, with the gain's when mix-order reduction fuses it in); and other
    sums (a gain's gradient alone, split reductions). A reading of names: the table by name is kept beside it."""
    counts = dict.fromkeys(("reductions", "norm_forward", "norm_backward", "other_sums", "kernels"), 0.0)
    for name, row in by_name.items():
        counts["kernels"] += row["count"]
        if not name.startswith(("triton_red_", "triton_per_")):
            continue
        counts["reductions"] += row["count"]
        norm, sums = any(op in name for op in ("rsqrt", "_mean")), "_sum" in name
        kind = ("norm_backward" if sums else "norm_forward") if norm else "other_sums" if sums else None
        if kind:
            counts[kind] += row["count"]
    return counts


# ---- the driver ----

class Worker:
    """A worker process and the replies it sends, read by a thread so that a reply can be waited for with a limit."""

    def __init__(self, setting: str, toy: bool, log: Path):
        env = os.environ | {MIX_ENV: SETTINGS[setting], "PYTHONUNBUFFERED": "1"}
        self.log_path, self.log = log, log.open("w")
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker"] + (["--toy"] if toy else []),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env, cwd=Path.cwd())
        self.replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.replies.put(json.loads(line))
        self.replies.put({"error": f"worker ended (exit {self.proc.wait()})", "ended": True})

    def reply(self, timeout: float) -> dict:
        try:
            return self.replies.get(timeout=max(timeout, 0.1))
        except queue.Empty:
            return {"error": "no reply within the command's time limit", "timed_out": True}

    def ask(self, cmd: dict, timeout: float) -> dict:
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except OSError as err:
            return {"error": f"worker gone: {err}", "ended": True}
        return self.reply(timeout)

    def close(self, grace: float) -> None:
        """Ask the worker to end; kill it (this process's own child) if it has not within `grace` seconds (0: a
        worker that did not answer in time)."""
        with contextlib.suppress(OSError):
            self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class WorkerLost(Exception):
    """A worker that did not answer by the command's limit, or ended."""


def summarize(result: dict) -> None:
    """Medians per model and the ratios, from the rounds so far."""
    out = result["summary"] = {}
    for d, rounds in result["rounds"].items():
        times: dict[str, list[float]] = {}
        for r in rounds:
            for key, row in r["times"].items():
                times.setdefault(key, []).extend(row.get("times_s", []))
        med = {k: statistics.median(t) for k, t in times.items() if t}
        ratios = {}
        if d == "1024":
            for m in MODELS_1024:
                ref = f"pre_ln:{m.setting}"
                if m.scheme == "keel" and m.key in med and ref in med:
                    ratios[f"{m.key} / {ref}"] = med[m.key] / med[ref]
                    ratios[f"{m.key} / {ref}, per round"] = [
                        statistics.median(r["times"][m.key]["times_s"]) / statistics.median(r["times"][ref]["times_s"])
                        for r in rounds if r["times"].get(m.key, {}).get("times_s") and
                        r["times"].get(ref, {}).get("times_s")]
            for w in SETTINGS:
                a, b = f"keel:chained:{w}", f"keel:one_pass:{w}"
                if a in med and b in med:
                    ratios[f"{b} / {a}"] = med[b] / med[a]
        else:  # within each phase, the held model against its partner, measured alternately
            phase_med = {}
            for r in rounds:
                for key, row in r["times"].items():
                    phase_med.setdefault((r["partner"], key), []).extend(row.get("times_s", []))
            held = HELD_2048.key
            for p in PARTNERS_2048:
                if phase_med.get((p.key, p.key)) and phase_med.get((p.key, held)):
                    ratios[f"{p.key} / {held}"] = (statistics.median(phase_med[(p.key, p.key)])
                                                   / statistics.median(phase_med[(p.key, held)]))
            chained, pre_ln = f"{PARTNERS_2048[0].key} / {held}", f"{PARTNERS_2048[1].key} / {held}"
            if chained in ratios and pre_ln in ratios:
                ratios[f"{held} / {PARTNERS_2048[1].key}"] = 1 / ratios[pre_ln]
                ratios[f"{PARTNERS_2048[0].key} / {PARTNERS_2048[1].key} (product of two)"] = (
                    ratios[chained] / ratios[pre_ln])
        out[d] = {"median_s": med, "n_steps": {k: len(t) for k, t in times.items()}, "ratios": ratios}


def run_window(out: Path, seconds: float, toy: bool) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    end = start + seconds
    result = {"command": sys.argv, "seconds": seconds, "toy": toy, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "plan": planned(), "settings": {"rounds": TOY_ROUNDS if toy else ROUNDS, "steps": TOY_STEPS if toy
              else STEPS, "rounds_2048": TOY_ROUNDS if toy else ROUNDS_2048, "steps_2048": TOY_STEPS if toy else
              STEPS_2048, "warmup": WARMUP, "profile_steps": TOY_PROFILE_STEPS if toy else PROFILE_STEPS,
              "boxes": BOXES},
              "status": {}, "workers": {}, "models": {}, "rounds": {},
              "profile": {}, "summary": {}, "part_s": {}}

    counts = result["settings"]

    def save() -> None:
        summarize(result)
        tmp = out / "norm_window.json.tmp"
        tmp.write_text(json.dumps(result, indent=1, default=str))
        tmp.replace(out / "norm_window.json")
        (out / "norm_window.md").write_text(markdown(result))

    workers = {w: Worker(w, toy, out / f"worker-{w}.log") for w in SETTINGS}

    def tell(setting: str, cmd: dict) -> dict:
        r = workers[setting].ask(cmd, end - time.monotonic())
        if r.get("timed_out") or r.get("ended"):
            raise WorkerLost(f"{setting} on {cmd['op']} {cmd.get('key', '')}: {r['error']}")
        return r

    def ask(model: Model, cmd: dict) -> dict:
        return tell(model.setting, cmd | {"key": model.key})

    budget = {"left": 0.0}

    def part(name: str, body) -> None:
        budget["left"] += BOXES[name]
        begun = time.monotonic()
        deadline = min(begun + budget["left"], end)
        result["status"][name] = "running"
        save()
        try:
            result["status"][name] = body(lambda: time.monotonic() > deadline) or "done"
        except WorkerLost as err:
            result["status"][name] = f"stopped: {err}"
            raise
        finally:
            result["part_s"][name] = time.monotonic() - begun
            budget["left"] -= result["part_s"][name]
            save()

    def build(models, d, over) -> str | None:
        for m in models:
            if over():
                return "time box reached"
            result["models"].setdefault(str(d), {})[m.key] = ask(m, {"op": "build", "d": d, "scheme": m.scheme,
                                                                     "junction": m.junction, "warmup": WARMUP})
            save()

    def rounds(d, models, n_rounds, n_steps, over, partner=None) -> str | None:
        held = [m for m in models if "error" not in result["models"].get(str(d), {}).get(m.key, {"error": 1})]
        rows = result["rounds"].setdefault(str(d), [])
        for r in range(n_rounds):
            if over():
                return f"{r} of {n_rounds} rounds (time box reached)"
            order = held if r % 2 == 0 else held[::-1]
            row = {"round": r, "order": [m.key for m in order], "times": {}}
            if partner:
                row["partner"] = partner
            rows.append(row)
            for m in order:
                row["times"][m.key] = ask(m, {"op": "steps", "n": n_steps})
                save()

    def profile(over) -> str | None:
        for m in MODELS_1024:
            if over():
                return "time box reached"
            if "error" not in result["models"].get("1024", {}).get(m.key, {"error": 1}):
                result["profile"][m.key] = ask(m, {"op": "profile", "n": counts["profile_steps"]})
                save()

    def d2048(over) -> str | None:
        for w in SETTINGS:  # the d=1024 models and their compiled graphs
            tell(w, {"op": "reset"})
        status = build([HELD_2048], 2048, over)
        for p in PARTNERS_2048:
            status = status or build([p], 2048, over) or rounds(2048, [HELD_2048, p], counts["rounds_2048"],
                                                                counts["steps_2048"], over, partner=p.key)
            ask(p, {"op": "free"})
        return status

    try:
        for w, proc in workers.items():
            hello = result["workers"][w] = proc.reply(end - time.monotonic()) | {MIX_ENV: SETTINGS[w]}
            if hello.get("timed_out") or hello.get("ended"):
                raise WorkerLost(f"{w} did not start: {hello['error']}")
        result["start_s"] = time.monotonic() - start
        save()
        part("build", lambda over: build(MODELS_1024, 1024, over))
        part("rounds", lambda over: rounds(1024, MODELS_1024, counts["rounds"], counts["steps"], over))
        part("profile", profile)
        part("d2048", d2048)
    except WorkerLost as err:
        result["stopped"] = str(err)
    finally:
        for w, proc in workers.items():
            proc.close(grace=min(20.0, max(0.0, end - time.monotonic())))
            result["workers"].setdefault(w, {})["log_tail"] = proc.log_path.read_text(errors="replace")[-1500:]
        for name in BOXES:
            result["status"].setdefault(name, "not run")
        result["seconds_used"] = time.monotonic() - start
        save()
    return result


# ---- the plan: PREDICTED seconds per part ----

def plan() -> dict:
    """PREDICTED seconds of each part beside its box (plan.py's method: the performance model calibrated on the
    newest H100 run for each step, its measured cold compile for each model's first step, BUILD_S and PROCESS_S
    assumed; PROFILE_S assumed for the profiler's tables). Mix-order off and the chained norms are not modelled:
    their steps are predicted at the default's time."""
    from plan import BUILD_S, PROCESS_S, _measured, step_s  # noqa: PLC0415

    from keel.bench.perf_model import calibrated  # noqa: PLC0415

    spec, cold = calibrated("H100"), max(_measured()["compile_warmup_s"].values())
    step = {(d, scheme): step_s(suite, spec, n, scheme, "compiled+composed", batch, 1)
            for d, (suite, n, batch) in shapes(False).items() for scheme in ("keel", "pre_ln")}
    built = {d: lambda m, d=d: BUILD_S + cold + WARMUP * step[(d, m.scheme)] for d in (1024, 2048)}
    parts = {
        "build": PROCESS_S + sum(built[1024](m) for m in MODELS_1024),
        "rounds": ROUNDS * sum((1 + STEPS) * step[(1024, m.scheme)] for m in MODELS_1024),
        "profile": sum(PROFILE_S + (1 + 2 * PROFILE_STEPS) * step[(1024, m.scheme)] for m in MODELS_1024),
        "d2048": sum(built[2048](m) for m in [HELD_2048, *PARTNERS_2048]) + ROUNDS_2048 * sum(
            (1 + STEPS_2048) * (step[(2048, HELD_2048.scheme)] + step[(2048, p.scheme)]) for p in PARTNERS_2048),
    }
    return {"device": spec.calibrated, "step_s": {f"{d} {s}": t for (d, s), t in step.items()},
            "parts": {p: {"predicted_s": t, "box_s": BOXES[p]} for p, t in parts.items()}, "slack_s": SLACK,
            "seconds": sum(BOXES.values()) + SLACK}


def planned() -> dict:
    """`plan()`, or what kept it from being made: the window measures either way."""
    try:
        return plan()
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"[:500]}


def plan_markdown(p: dict) -> str:
    steps = ", ".join(f"d={k.split()[0]} {k.split()[1]} {1e3 * t:.0f} ms" for k, t in p["step_s"].items())
    lines = [f"PREDICTED seconds of each part (`norm_window.plan()`; step times by the model calibrated on "
             f"{p['device']}: {steps}):", "", "| part | predicted (s) | box (s) |", "|---|---|---|"]
    lines += [f"| {name} | {r['predicted_s']:.0f} | {r['box_s']} |" for name, r in p["parts"].items()]
    total = sum(r["predicted_s"] for r in p["parts"].values())
    lines.append(f"| all, with {p['slack_s']} s to start and end | {total + p['slack_s']:.0f} | {p['seconds']} |")
    return "\n".join(lines) + "\n"


# ---- the table ----

def markdown(result: dict) -> str:
    hello = next(iter(result["workers"].values()), {}).get("machine", {})
    lines = [f"# Junction norms on {hello.get('gpu') or hello.get('cpu', '?')} (torch {hello.get('torch_version')}, "
             f"keel {hello.get('keel_version')} {hello.get('git_commit') or ''})", "",
             "Status: " + ", ".join(f"{k} {v}" for k, v in result["status"].items()), "",
             *([f"Stopped: {result['stopped']}", ""] if result.get("stopped") else []),
             "Workers: " + "; ".join(f"{w} ({MIX_ENV}={r.get(MIX_ENV)}, Inductor's triton.mix_order_reduction = "
                                     f"{r.get('mix_order_reduction', r.get('error'))})"
                                     for w, r in result["workers"].items()), ""]
    if "parts" in (result.get("plan") or {}):
        lines += [plan_markdown(result["plan"]), ""]
    for d, models in result["models"].items():
        s = result["summary"].get(d, {"median_s": {}, "n_steps": {}, "ratios": {}})
        lines += [f"## d={d} (measured)", "", "| model | build (s) | warm-up steps (s) | graphs | norm pairs one-pass "
                  "/ chained | timed steps | median step (ms) | worker's peak (GiB) |", "|---" * 8 + "|"]
        for key, m in models.items():
            if "error" in m:
                lines.append(f"| {key} | failed: {m['error'].strip().splitlines()[-1][:200]} | | | | | | |")
                continue
            peaks = [row["times"][key].get("peak_memory_bytes") or 0 for row in result["rounds"].get(d, [])
                     if key in row["times"]]
            med = s["median_s"].get(key)
            lines.append(f"| {key} | {m['build_s']:.1f} | {', '.join(f'{t:.1f}' for t in m['warmup_s'])} | "
                         f"{m['graphs']} | {m['norm_pairs']['one_pass']} / {m['norm_pairs']['chained']} | "
                         f"{s['n_steps'].get(key, 0)} | {f'{1e3 * med:.1f}' if med else '-'} | "
                         f"{max(peaks, default=0) / 2**30:.1f} |")
        lines += ["", "Ratios of median step times (each pair measured alternately):", ""]
        lines += [f"- {k}: " + (", ".join(f"{x:.3f}" for x in v) if isinstance(v, list) else f"**{v:.3f}**")
                  for k, v in s["ratios"].items()]
        lines.append("")
    if result["profile"]:
        lines += ["## Kernels per step, by name (measured; counts by what the names say they fuse)", "",
                  "| model | all kernels | reductions | RMSNorm forward | RMSNorm backward | other sums | kernel ms |",
                  "|---|---|---|---|---|---|---|"]
        for key, p in result["profile"].items():
            if "error" in p:
                lines.append(f"| {key} | failed: {p['error'].strip().splitlines()[-1][:200]} | | | | | |")
                continue
            c = p["counts"]
            lines.append(f"| {key} | {c['kernels']:.0f} | {c['reductions']:.0f} | {c['norm_forward']:.0f} | "
                         f"{c['norm_backward']:.0f} | {c['other_sums']:.0f} | {p['total_ms']:.1f} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, nargs="?")
    p.add_argument("--seconds", type=float, default=sum(BOXES.values()) + SLACK,
                   help="the whole command's limit; replies not in by then are given up on")
    p.add_argument("--toy", action="store_true", help="every part at CPU-test size")
    p.add_argument("--plan", action="store_true", help="print the PREDICTED time of each part (the README's table)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.toy)
    if args.plan:
        return print(plan_markdown(plan()), end="")
    if args.out is None:
        p.error("OUT is required")
    if not args.toy and not torch.cuda.is_available():
        p.error("needs a CUDA device (its sizes are a GPU's); --toy runs it at toy size here")
    result = run_window(args.out, args.seconds, args.toy)
    print(markdown(result))


if __name__ == "__main__":
    main()
