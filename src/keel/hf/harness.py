"""`keel lm-eval`: lm-evaluation-harness on a run directory (exported first) or a `transformers` model directory."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

from keel import safe_io
from keel.errors import ExportError, optional
from keel.evals.in_memory_lm import fetch_failure, fetch_message, find_tasks
from keel.hf import register
from keel.hf.export import export_run
from keel.hf.import_hf import read_json


def _evaluate(hf_dir: Path, tasks: list[str], include_path: str | None, device: str, batch_size: int,
              num_fewshot: int | None, limit: float | None) -> dict:
    optional("lm_eval.models.huggingface", "eval", "keel lm-eval", ExportError)  # it also needs accelerate
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    register()  # KeelForCausalLM with the Auto classes HFLM uses

    task_manager, unknown = find_tasks(tasks, include_path)
    if unknown:
        where = f" (also looked in {include_path})" if include_path else " (add --include-path DIR for your own)"
        raise ExportError(f"--tasks: unknown task {unknown[0]!r}{where}")
    # the harness prefixes empty contexts with BOS or EOS; a byte-level tokenizer has neither, so it gets
    # byte 0 (NUL), the one choice that keeps every id a plain byte
    tokenizer_config = _tokenizer_config(hf_dir / "tokenizer_config.json")
    has_special = any(tokenizer_config.get(k) for k in ("bos_token", "eos_token"))
    lm = HFLM(pretrained=str(hf_dir), backend="causal", device=device, batch_size=batch_size, dtype="float32",
              prefix_token_id=None if has_special else 0)
    try:
        return simple_evaluate(model=lm, tasks=tasks, task_manager=task_manager, num_fewshot=num_fewshot,
                               limit=limit, log_samples=False)
    except Exception as err:  # a task whose data set must be downloaded, offline: one line, not a traceback
        reason = fetch_failure(err)
        if reason is None:
            raise
        raise ExportError(fetch_message("--tasks", tasks, reason)) from None


def run_lm_eval(path, tasks: list[str], include_path: str | None = None, device: str = "cpu", batch_size: int = 1,
                num_fewshot: int | None = None, limit: float | None = None, checkpoint: str | None = None,
                output: str | None = None) -> tuple[dict, Path]:
    """Evaluate `path` on `tasks`; write the harness's results JSON (default: into `path`); return both."""
    path = Path(path)
    if (path / "config.yaml").is_file():
        with tempfile.TemporaryDirectory(prefix="keel-export-") as tmp:
            results = _evaluate(export_run(path, Path(tmp) / "hf", checkpoint), tasks, include_path, device,
                                batch_size, num_fewshot, limit)
    elif (path / "config.json").is_file():
        results = _evaluate(path, tasks, include_path, device, batch_size, num_fewshot, limit)
    else:
        raise ExportError(f"{path}: neither a Keel run directory (config.yaml) nor a transformers model "
                          "directory (config.json)")
    results.pop("samples", None)
    name = re.sub(r"[^\w.-]+", "_", "+".join(tasks))[:100]
    out = Path(output) if output else path / f"lm_eval-{name}.json"
    safe_io.write_text(out.parent, out, json.dumps(results, indent=1, default=str))  # never through a planted link
    return results, out


def _tokenizer_config(path: Path) -> dict:
    """tokenizer_config.json as an object ({} when absent): a regular file of bounded size and depth."""
    if not os.path.lexists(path):
        return {}
    config = read_json(path, "a tokenizer config")
    if not isinstance(config, dict):
        raise ExportError(f"{path}: holds a JSON {type(config).__name__}, not an object")
    return config
