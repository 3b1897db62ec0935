"""A tiny multiple-choice task on Python source for lm-evaluation-harness tests, as rows and as a local task
YAML; the right choice is moved around (answer i % 4), so accuracy is not trivial."""

import json

QUESTIONS = [
    ("def add(a, b):", ["return a + b", "import os", "while True", "pass  # no"]),
    ("for i in", ["range(10):", "42", "None", "]["]),
    ("import", ["sys", "(((", "12345", "= =", ]),
    ("class Point", ["(object):", ";;", "0x", "else"]),
    ("print(", ["'hello')", "}}", "\\n", "#"]),
    ("x = [1, 2,", ["3]", "def", "{", "import"]),
    ("if x is", ["None:", "7", "((", "return"]),
    ("while", [" True:", "0.5", "->", "@"]),
]
ROWS = [{"question": q, "choices": c[-(i % 4):] + c[:-(i % 4)] if i % 4 else c, "answer": i % 4}
        for i, (q, c) in enumerate(QUESTIONS)]


def write_local_task(folder) -> str:
    """ROWS as the lm-evaluation-harness task `keel_tiny_mc` (acc and acc_norm) in `folder`; returns its YAML path."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (folder / "tiny_mc.yaml").write_text(f"""task: keel_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'data.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
""")
    return str(folder / "tiny_mc.yaml")
