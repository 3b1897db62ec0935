"""The package's architecture, checked from its source: what may import what, and where training happens."""

import ast
from pathlib import Path

import keel

SRC = Path(keel.__file__).parent


def imports(path: Path) -> set[str]:
    """Every module a file imports (absolute names; `from . import x` does not occur in keel)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_model_package_imports_only_torch_and_itself():
    """keel.model is what export-hf ships beside the weights: nothing else from keel, nothing but torch."""
    allowed_third_party = {"torch"}
    for path in sorted((SRC / "model").glob("*.py")):
        for name in imports(path):
            top = name.split(".")[0]
            if top == "keel":
                assert name == "keel.model" or name.startswith("keel.model."), f"{path.name} imports {name}"
            else:
                import sys

                assert top in sys.stdlib_module_names or top in allowed_third_party or top == "__future__", \
                    f"{path.name} imports {name}"


def test_nothing_imports_the_command_line():
    offenders = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                 if p.name != "cli.py" or p.parent != SRC
                 if any(n == "keel.cli" for n in imports(p))]
    assert offenders == []


def test_lower_layers_do_not_import_upper_ones():
    """model < data < scale < train < experiments/hf < cli: each layer imports only those below it."""
    order = ["model", "data", "scale", "train", "experiments"]
    for i, layer in enumerate(order):
        above = {f"keel.{u}" for u in order[i + 1:]} | {"keel.cli"}
        for path in (SRC / layer).rglob("*.py"):
            bad = {n for n in imports(path) if any(n == a or n.startswith(a + ".") for a in above)}
            assert not bad, f"keel/{layer}/{path.name} imports {sorted(bad)}"


def test_one_training_step_implementation():
    """Backward passes, clipping and optimiser steps live in keel/train/step.py; the only other backward is
    gradflow's gradient measurement, which takes no optimiser step."""
    found = {}
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        for needle in (".backward(", "clip_grad_norm_(", "optimizer.step()", "opt.step()"):
            if needle in text:
                found.setdefault(needle, set()).add(str(path.relative_to(SRC)))
    assert found["clip_grad_norm_("] == {"train/step.py"}
    assert found["optimizer.step()"] == {"train/step.py"} and "opt.step()" not in found
    assert found[".backward("] <= {"train/step.py", "experiments/gradflow.py", "kernels/junction.py"}


def test_public_api_still_at_the_top():
    from keel import PRESETS, SCHEMES, ModelConfig, TransformerLM, count_params, flops_per_token, preset

    config = preset("tiny")
    assert isinstance(config, ModelConfig) and set(SCHEMES) >= {"keel", "pre_ln"} and "paper-512" in PRESETS
    assert count_params(config) == sum(p.numel() for p in TransformerLM(config).parameters())
    assert flops_per_token(config) > 0
