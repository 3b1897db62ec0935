"""The package's architecture, checked from its source: what may import what, and where training happens."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import keel

SRC = Path(keel.__file__).parent

_BELOW_TRAIN = {"_version", "errors", "safe_io", "runtime", "model", "kernels", "data", "scale"}
# What each part of the package may import from keel besides itself, lowest first; docs/development.md lists
# the parts in this order. `keel` itself (`__init__`) is the public API: nothing inside the package imports it.
LAYERS = {
    "_version": set(),
    "errors": set(),
    "_lazy": set(),  # packages' names loaded on first use
    "launch": set(),  # the keel command's process settings, before torch loads
    "safe_io": {"errors"},
    "runtime": {"_version", "errors"},
    "model": {"_lazy"},  # torch only: `export-hf` ships its modules (not its __init__, which names them lazily)
    "kernels": {"_lazy"},  # torch and triton only (and the package's lazy names): scale applies them, bench times them
    "data": {"_lazy", "errors", "safe_io"},
    "scale": {"errors", "runtime", "model", "kernels"},
    "evals": {"_lazy", "errors", "safe_io", "runtime", "model", "data", "scale"},
    # the config of the whole program: every command's merge, field reads and presets
    "config": {"errors", "runtime", "model", "data", "scale", "evals"},
    # run directories: the run dir, checkpoints, resume and the trust layer over what a run holds
    "runs": {"errors", "safe_io", "runtime", "model", "data", "evals", "config"},
    # what a run will be and was: the plan, tables, plots, trackers
    "reporting": _BELOW_TRAIN | {"config", "runs"},
    "train": _BELOW_TRAIN | {"evals", "config", "runs", "reporting"},
    "generate": {"model"},
    "hf": _BELOW_TRAIN | {"evals", "config", "runs"},
    "experiments": _BELOW_TRAIN | {"train", "evals", "config", "runs", "reporting"},
    "bench": _BELOW_TRAIN | {"train", "evals", "config", "reporting"},
    "cli": _BELOW_TRAIN | {"config", "runs", "reporting", "train", "generate", "hf", "experiments", "bench", "evals",
            "launch"},
    "__init__": {"_version", "_lazy", "model"},
}


def imports(path: Path) -> set[str]:
    """Every module a file imports, as absolute names (relative imports resolved against its package)."""
    package = ".".join(("keel", *path.relative_to(SRC).parent.parts))
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                names.add(f"{base}.{node.module}" if node.module else base)
            elif node.module == "keel":  # `from keel import evals` imports the submodule keel.evals (or the API)
                names |= {f"keel.{a.name}" if (SRC / a.name).is_dir() or (SRC / f"{a.name}.py").exists() else "keel"
                          for a in node.names}
            else:
                names.add(node.module)
    return names


def part_of(path: Path) -> str:
    """The entry of LAYERS a source file belongs to: its top-level package, or its own name at the top."""
    relative = path.relative_to(SRC)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def keel_part(name: str) -> str | None:
    """The part of keel a module name points into (`__init__` for `keel` itself); None outside keel."""
    if name == "keel":
        return "__init__"
    return name.split(".")[1] if name.startswith("keel.") else None


def test_every_import_inside_keel_follows_the_layer_table():
    unknown = sorted({part_of(p) for p in SRC.rglob("*.py")} - set(LAYERS))
    assert not unknown, f"add {unknown} to LAYERS here and to docs/development.md's layer table"
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        part = part_of(path)
        for name in sorted(imports(path)):
            target = keel_part(name)
            if target is not None and target != part and target not in LAYERS[part]:
                bad.append(f"keel/{path.relative_to(SRC)} ({part}) imports {name}")
    assert bad == []


def test_the_layer_table_has_no_cycles():
    """So it is an order: every part can be listed after everything it may import."""
    placed: list[str] = []
    while len(placed) < len(LAYERS):
        ready = [p for p in LAYERS if p not in placed and LAYERS[p] <= set(placed)]
        assert ready, f"a cycle among {sorted(set(LAYERS) - set(placed))}"
        placed += ready


def module_imports(path: Path) -> set[str]:
    """The keel modules a file imports, each by its own name: `from keel.evals import scoring` is keel.evals.scoring
    where that is a module, else keel.evals (its package's __init__)."""
    package = ".".join(("keel", *path.relative_to(SRC).parent.parts))
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{up}.{base}" if base else up
            for a in node.names:
                sub = SRC.parent.joinpath(*f"{base}.{a.name}".split("."))
                names.add(f"{base}.{a.name}" if sub.is_dir() or sub.with_suffix(".py").exists() else base)
    return {n for n in names if n == "keel" or n.startswith("keel.")}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_module_imports_itself_through_others():
    """No import circle between modules, counting imports inside functions (a deferred import hides a circle
    from Python, not from a reader): the strongly connected parts of the import graph are single modules."""
    graph = {module_name(p): module_imports(p) for p in SRC.rglob("*.py")}
    index, low, stack, on_stack, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's algorithm
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                circles.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert circles == []


@pytest.mark.slow  # over a second in tests/durations.json
def test_the_library_imports_no_study():
    """The studies (research/keel_studies) run on the library, never the other way round: no module of the package
    imports them (keel.experiments finds them by name, at run time, for `keel experiment` and `keel sweep`)."""
    offenders = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                       if any(n.split(".")[0] == "keel_studies" for n in imports(p)))
    assert offenders == []


def test_no_two_modules_share_a_name():
    """A module's name says which one it is: no two files in the package have the same stem (`__init__` and
    `__main__` aside)."""
    stems = {}
    for path in SRC.rglob("*.py"):
        if path.stem not in ("__init__", "__main__"):
            stems.setdefault(path.stem, []).append(str(path.relative_to(SRC)))
    assert {s: paths for s, paths in stems.items() if len(paths) > 1} == {}


def test_the_model_package_imports_only_torch_and_itself():
    """keel.model's modules are what export-hf ships beside the weights: nothing else from keel, nothing but torch.
    Its __init__ (not shipped) may use keel._lazy."""
    allowed_third_party = {"torch"}
    for path in sorted((SRC / "model").glob("*.py")):
        if path.name == "__init__.py":
            assert imports(path) == {"keel._lazy"}, imports(path)
            continue
        for name in imports(path):
            top = name.split(".")[0]
            if top == "keel":
                assert name == "keel.model" or name.startswith("keel.model."), f"{path.name} imports {name}"
            else:
                assert top in sys.stdlib_module_names or top in allowed_third_party or top == "__future__", \
                    f"{path.name} imports {name}"


def test_nothing_imports_the_command_line():
    offenders = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                 if part_of(p) != "cli"  # the command's own package (its __main__ runs keel.cli.main)
                 if any(n == "keel.cli" or n.startswith("keel.cli.") for n in imports(p))]
    assert offenders == []


def test_import_keel_loads_no_hugging_face_and_installs_no_import_hook():
    """`import keel` is the model: no `transformers`, no `keel.hf`, and `sys.meta_path` left as it was
    (registration with the Auto classes is `keel.hf.register()`, called by whoever wants it)."""
    script = """
import sys
finders = list(sys.meta_path)
import keel
assert sys.meta_path == finders, f"sys.meta_path changed: {sys.meta_path}"
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "transformers" or m.startswith("keel.hf"))
assert not loaded, f"import keel loaded {loaded[:5]}"
import keel.hf
assert sys.meta_path == finders and "transformers" not in sys.modules, "import keel.hf needs no transformers"
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_one_training_step_implementation():
    """Backward passes, clipping and optimiser steps live in keel/train/step.py; the only other backwards are
    the count of operators a sub-layer adds (bench/core.py), which takes no optimiser step."""
    found = {}
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        for needle in (".backward(", "clip_grad_norm_(", "clip_grads_with_norm_(", "self.clip", "optimizer.step()",
                       "opt.step()"):
            if needle in text:
                found.setdefault(needle, set()).add(str(path.relative_to(SRC)))
    assert found["self.clip"] == {"train/step.py"}  # TrainStep scales the gradients by its clip itself
    assert found.get("clip_grad_norm_(", set()) | found.get("clip_grads_with_norm_(", set()) <= {"train/step.py"}
    assert found["optimizer.step()"] == {"train/step.py"} and "opt.step()" not in found
    assert found[".backward("] <= {"train/step.py", "research/keel_studies/gradflow.py", "kernels/junction.py",
                                   "bench/core.py"}


def test_public_api_still_at_the_top():
    from keel import PRESETS, SCHEMES, ModelConfig, TransformerLM, count_params, flops_per_token, preset

    config = preset("tiny")
    assert isinstance(config, ModelConfig) and set(SCHEMES) >= {"keel", "pre_ln"} and "paper-512" in PRESETS
    assert count_params(config) == sum(p.numel() for p in TransformerLM(config).parameters())
    assert flops_per_token(config) > 0


def test_every_preset_is_a_function_at_the_top():
    """The README says a preset is `keel.preset(name)` "or the functions themselves": each is `keel.<name>`."""
    assert {name: getattr(keel, name.replace("-", "_"), None) for name in keel.PRESETS} == keel.PRESETS
    assert {name.replace("-", "_") for name in keel.PRESETS} <= set(keel.__all__)


def test_the_readmes_map_names_every_module():
    """README.md's map of src/keel/: each package's row names every module in it (bare or by path)."""
    readme = (SRC.parent.parent / "README.md").read_text()
    section = readme.split("## Map of `src/keel/`", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"`\w+/`", cells[0]):
            rows[cells[0].strip("`/")] = {Path(n).stem for n in re.findall(r"`([^`]+)`", cells[2])}
    assert rows, "no package rows found in README.md's map"
    packages = {p.parent.name for p in SRC.glob("*/__init__.py")}
    assert set(rows) == packages
    missing = {f"{package}/{p.name}" for package in packages for p in (SRC / package).glob("*.py")
               if p.name != "__init__.py" and p.stem not in rows[package]}
    assert missing == set(), "name these modules in README.md's map of src/keel/"


def test_the_paths_contributing_names_exist():
    repo = SRC.parent.parent
    named = re.findall(r"`((?:src|tests|\.ci)/[\w./-]+)`", (repo / "CONTRIBUTING.md").read_text())
    assert named and [p for p in named if not (repo / p).exists()] == []


@pytest.mark.slow  # over a second in tests/durations.json
def test_every_test_that_starts_the_triton_interpreter_is_slow():
    """A child process under TRITON_INTERPRET=1 takes minutes on a small machine: not for the fast tier.
    Checked from the test files: a test that starts one, itself or through a fixture of its file, is slow."""
    def is_slow(node) -> bool:
        return any("mark.slow" in ast.unparse(d) for d in node.decorator_list)

    fast = []
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        if path.name == Path(__file__).name:  # this very test names the variable
            continue
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.Assign) and "pytestmark" in ast.unparse(n) and "slow" in ast.unparse(n)
               for n in tree.body):
            continue
        functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
        starts = {f.name for f in functions if "TRITON_INTERPRET" in ast.unparse(f)}
        fast += [f"{path.name}::{f.name}" for f in functions if f.name.startswith("test_") and not is_slow(f)
                 and (f.name in starts or starts & {a.arg for a in f.args.args})]
    assert fast == []


def test_the_readmes_layer_table_is_this_one():
    """docs/development.md states the layer table in words; it must say exactly what LAYERS enforces."""
    readme = (SRC.parent.parent / "docs" / "development.md").read_text()
    section = readme[readme.index("| part | may import |"):]
    rows = {}
    for line in section.splitlines()[2:]:
        if not line.startswith("| `"):
            break
        part, allowed = (cell.strip() for cell in line.strip("|").split("|"))
        rows[re.findall(r"`([^`]+)`", part)[0]] = set(re.findall(r"`([^`]+)`", allowed))
    assert rows == LAYERS


def test_the_file_map_names_every_file_and_only_files_that_exist():
    """docs/development.md's file map says "every file, one line each": every module under src/keel (a
    sub-package's __init__ has its package's row) and every file under tests/ has a row, and every path a row's
    first cell names exists (module paths relative to src/keel, the rest to the repository)."""
    repo = SRC.parent.parent
    section = (repo / "docs" / "development.md").read_text().split("## File map", 1)[1]
    named = [name for line in section.splitlines() if line.startswith("| ")
             for name in re.findall(r"`([^`]+)`", line.split("|")[1])]
    assert named, "no rows found under '## File map'"

    def exists(name: str) -> bool:
        return (repo / name).exists() or (SRC / name).exists()

    files = [f"src/keel/{p.relative_to(SRC).as_posix()}" for p in sorted(SRC.rglob("*.py"))
             if not (p.name == "__init__.py" and p.parent != SRC)]
    files += [p.relative_to(repo).as_posix() for p in sorted((repo / "tests").rglob("*"))
              if p.is_file() and "__pycache__" not in p.parts]
    listed = set(named) | {f"src/keel/{n}" for n in named}
    assert [f for f in files if f not in listed] == [], "add a row to docs/development.md's file map"
    assert [n for n in named if not exists(n)] == [], "the file map names a path that does not exist"
    assert len(named) == len(set(named)), "a file has two rows"
