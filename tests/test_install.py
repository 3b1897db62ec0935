"""The install: light for users (what train, eval, generate and plot need, no triton), heavy extras for
developers; CI installs what the README tells a developer; the README names the run files and quotes globs."""

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
TRAINING_DOC = (ROOT / "docs" / "training.md").read_text()  # run directories, tracking
DOCS = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


def test_light_install_has_what_train_eval_generate_plot_need_and_no_triton():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    for needed in ("torch", "numpy", "omegaconf", "safetensors", "tokenizers", "tqdm", "matplotlib"):
        assert needed in core
    for heavy in ("triton", "transformers", "lm_eval", "tensorboard", "datasets", "wandb"):
        assert heavy not in core
    extras = project["optional-dependencies"]
    assert any(d.startswith("triton") for d in extras["kernels"])
    assert any(d.startswith("triton") for d in extras["test"])  # tests/test_junction.py runs its interpreter


@pytest.mark.slow
def test_train_eval_generate_plot_run_on_the_light_install(tmp_path):
    """With every package outside the light install made unimportable, the user's commands still work."""
    heavy = ["triton", "transformers", "lm_eval", "tensorboard", "datasets", "pyarrow", "wandb", "accelerate",
             "hypothesis"]
    code = f"""
import importlib.machinery as machinery, sys
class LightInstall(machinery.PathFinder):  # site-packages as if the heavy packages were never installed
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.split(".")[0] in {heavy!r} else super().find_spec(name, path, target)
sys.meta_path = [LightInstall if f is machinery.PathFinder else f for f in sys.meta_path]
import importlib.util
assert importlib.util.find_spec("transformers") is None and importlib.util.find_spec("matplotlib") is not None
from keel.cli import main
run = {str(tmp_path / "r")!r}
assert main(["train", "--preset", "tiny", "run.steps=2", "run.out_dir={tmp_path}", "run.name=r"]) == 0
assert main(["eval", run, "--batches", "1"]) == 0
assert main(["generate", run, "--max-new-tokens", "3"]) == 0
assert main(["plot", run]) == 0
assert main(["runs", {str(tmp_path)!r}]) == 0
assert not any(m.split(".")[0] in {heavy!r} for m in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_ci_installs_what_the_readme_tells_a_developer():
    quick_start = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"pip install -c constraints.txt -e \.\s", quick_start)  # the light install, for a user
    ci = (ROOT / ".ci" / "run").read_text()
    install = next(line.strip() for line in ci.splitlines() if line.strip().startswith("pip install"))
    assert install in quick_start, install


def test_readme_names_the_files_and_quotes_the_globs():
    assert "`eval-" in TRAINING_DOC.split("A run directory holds", 1)[1][:800]  # the run files include eval-*.json
    assert "run.log_to=[tensorboard]" not in DOCS.replace("'run.log_to=[tensorboard]'", "")
    assert "run.threads" in README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "run.steps=50" in README


def test_hf_and_runs_are_ignored_by_git():
    for path in ("hf/config.json", "runs/x/config.yaml"):
        proc = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
        assert proc.returncode == 0, path
    assert subprocess.run(["git", "check-ignore", "-q", "src/keel/hf/new.py"], cwd=ROOT).returncode == 1
