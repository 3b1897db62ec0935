"""The README's "Using the library" Python block, run as written (read from README.md at test time)."""

import math
import re
from pathlib import Path

import torch

from keel.model.transformer import lm_loss

README = Path(__file__).resolve().parents[1] / "README.md"


def library_code() -> str:
    """The ```python blocks of the README's "Using the library" section, joined."""
    section = README.read_text().split("## Using the library", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "no Python block under 'Using the library'"
    return "\n".join(blocks)


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
