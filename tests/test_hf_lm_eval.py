"""`keel lm-eval` end to end on a local multiple-choice task: the harness's accuracy equals the one
computed here from the project's own model, choice by choice."""

import json

import pytest
import torch

from keel.cli import main
from keel.data.tokenizer import ByteTokenizer
from keel.runs.run_dir import load_model as load_run
from mc_task import ROWS, write_local_task

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")


def log_likelihood(model, context: str, continuation: str) -> float:
    ctx, cont = ByteTokenizer().encode(context), ByteTokenizer().encode(continuation)
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = model(ids[:, :-1])[0].log_softmax(-1)[0]  # (T-1, V): position t predicts token t+1
    return sum(logp[len(ctx) - 1 + i, tok].item() for i, tok in enumerate(cont))


@pytest.mark.slow
def test_lm_eval_on_a_local_task_matches_our_own_scoring(tmp_path, monkeypatch, capsys, make_run):
    tasks = tmp_path / "tasks"
    write_local_task(tasks)
    make_run(tmp_path / "run")
    _, model, _, _ = load_run(tmp_path / "run")
    model.eval()
    # the harness scores " " + choice after the question (its default target delimiter) and picks the best
    picks = [max(range(4), key=lambda j: log_likelihood(model, r["question"], " " + r["choices"][j])) for r in ROWS]
    expected = sum(p == r["answer"] for p, r in zip(picks, ROWS)) / len(ROWS)

    capsys.readouterr()
    assert main(["lm-eval", str(tmp_path / "run"), "--tasks", "keel_tiny_mc", "--include-path", str(tasks),
                 "--device", "cpu"]) == 0
    written = json.loads((tmp_path / "run" / "lm_eval-keel_tiny_mc.json").read_text())
    acc = written["results"]["keel_tiny_mc"]["acc,none"]
    print(f"lm-eval acc {acc} (own scoring {expected}, picks {picks})")
    assert acc == pytest.approx(expected, abs=1e-12)
    assert len(set(picks)) > 1  # the model is not indifferent, so matching picks mean matching scores
    assert "results: " in capsys.readouterr().out
