"""The README's "Using the library" Python blocks, run as written (read from README.md at test time), and its
lm-eval task YAML."""

import json
import math
import re
from pathlib import Path

import pytest
import torch

from keel.model.transformer import lm_loss

README = Path(__file__).resolve().parents[1] / "README.md"


def library_blocks() -> list[str]:
    """The ```python blocks of the README's "Using the library" section: the model, then train/eval/generate."""
    section = README.read_text().split("## Using the library", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 2, "expected two Python blocks under 'Using the library'"
    return blocks


def library_code() -> str:
    return library_blocks()[0]


def test_readme_library_example_trains_a_next_token_model():
    """Its loss is the next-token loss (checked against an independent shift), and 30 AdamW steps of the
    README's own call lower it as a next-token model's would: the copy task (targets=idx) falls to ~0.01."""
    torch.manual_seed(0)
    code = library_code()
    ns: dict = {}
    exec(compile(code, str(README), "exec"), ns)
    model, idx = ns["model"], ns["idx"]
    assert idx.shape[1] >= 2
    call = next(line.split("#")[0] for line in code.splitlines() if "loss = model(" in line)
    with torch.no_grad():
        logits, _ = model(idx[:, :-1])
        expected = lm_loss(logits, idx[:, 1:])  # position t predicts token t + 1
    assert torch.allclose(ns["loss"], expected, atol=1e-5), (ns["loss"], expected)
    assert abs(ns["loss"].item() - math.log(ns["config"].vocab_size)) < 1.0  # starts near uniform

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(30):
        exec(call, ns)
        ns["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    exec(call, ns)
    assert ns["loss"].item() > 0.5  # random tokens' next token cannot be copied from the input


def test_readme_train_evaluate_generate_from_python(tmp_path, monkeypatch):
    """The second block trains a run into ./runs, evaluates it and samples from it: the same numbers the
    run's own summary and a next-token evaluation of the saved model give."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    threads = torch.get_num_threads()
    first, second = library_blocks()
    ns: dict = {}
    try:
        exec(compile(first, str(README), "exec"), ns)
        exec(compile(second, str(README), "exec"), ns)
    finally:
        torch.set_num_threads(threads)
    summary, result, run_dir = ns["summary"], ns["result"], Path(ns["trainer"].run_dir)
    assert run_dir.resolve().parent == tmp_path.resolve() / "runs"
    assert summary["steps"] == 20 and not summary["interrupted"]
    assert json.loads((run_dir / "summary.json").read_text())["final_val_loss"] == summary["final_val_loss"]
    assert result["val_loss"] == pytest.approx(summary["final_val_loss"], rel=1e-5)  # same split, same batches
    text, tokenizer = ns["text"], ns["tokenizer"]
    assert text.startswith("def ") and len(tokenizer.encode(text)) == len(tokenizer.encode("def ")) + 20


def _readme_block(after: str, lang: str) -> str:
    section = README.read_text().split(after, 1)[1]
    return re.search(rf"```{lang}\n(.*?)```", section, flags=re.S)[1]


@pytest.mark.slow
def test_readme_lm_eval_task_yaml_runs_offline(tmp_path, monkeypatch, capsys):
    """The README's task YAML and data lines, written where it says, score with `keel lm-eval` offline."""
    pytest.importorskip("lm_eval")
    from keel.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    yaml_text = _readme_block("A task of your own reads", "yaml")
    path = yaml_text.splitlines()[0].removeprefix("# ").strip()
    (tmp_path / path).parent.mkdir(parents=True)
    (tmp_path / path).write_text(yaml_text)
    data = _readme_block(path.split("/")[0] + "/", "json")
    assert all(json.loads(line) for line in data.splitlines())
    (tmp_path / "my_tasks" / "my_task.jsonl").write_text(data)
    assert main(["train", "--preset", "tiny", "run.steps=2", "run.eval_every=0", "run.out_dir=runs",
                 "run.name=r"]) == 0
    capsys.readouterr()
    assert main(["lm-eval", "runs/r", "--tasks", "my_task", "--include-path", "my_tasks", "--device", "cpu"]) == 0
    results = json.loads((tmp_path / "runs" / "r" / "lm_eval-my_task.json").read_text())["results"]["my_task"]
    assert 0 <= results["acc,none"] <= 1
