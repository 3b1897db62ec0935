"""Everything from outside is untrusted: a downloaded run's config, a Hugging Face directory, a token
cache, a checkpoint's contents, JSON from anywhere. Every case is a real `keel` command that must end in one
line naming the field or file and exit 2 (never a traceback, a hang or memory exhaustion), and must leave what
lies outside the run unread or unwritten."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from damage import refused, victim
from keel.cli import main

# none of these checks curves.png: a test's own in-process runs skip it (the module's trained run and the `keel`
# subprocesses still draw it)
pytestmark = pytest.mark.usefixtures("no_curves")


@pytest.fixture(scope="module")
def trained(tiny_two_step_run) -> Path:
    """A tiny run trained for 2 steps on a corpus outside it, with its token cache outside it."""
    return tiny_two_step_run  # made once for the session (tests/conftest.py)


@pytest.fixture
def run(trained, tmp_path) -> Path:
    return victim(trained, tmp_path)


def edit_config(run: Path, **fields) -> None:
    """Set dotted fields of the run's config.yaml, as someone editing a run before sharing it would."""
    config = yaml.safe_load((run / "config.yaml").read_text())
    for key, value in fields.items():
        section, name = key.split("__")
        config[section][name] = value
    (run / "config.yaml").write_text(yaml.safe_dump(config))


EVAL = ("eval", "--batches", "1", "--device", "cpu")


# ---- 1. a downloaded run's config is not obeyed as if the user typed it ---------------------------------------
@pytest.mark.slow  # over a second in tests/durations.json
def test_a_config_naming_a_private_file_and_a_shared_cache_is_refused(run, tmp_path, capsys):
    private = tmp_path / "private" / "id_rsa"
    private.parent.mkdir()
    private.write_bytes(b"-----BEGIN PRIVATE KEY-----\n" * 100)
    shared = tmp_path / "shared"
    shared.mkdir()
    edit_config(run, data__source=str(private), data__cache_dir=str(shared))
    line = refused(capsys, "data.source", EVAL[0], run, *EVAL[1:])
    assert "outside the run directory" in line and "KEEL_TRUST_CONFIG=1" in line
    assert list(shared.iterdir()) == []  # no token ids of the private file were written there


def test_an_unedited_run_signed_by_another_user_is_not_trusted(run, tmp_path, monkeypatch, capsys):
    """The run as downloaded: config and signature intact, but no key here made the signature."""
    monkeypatch.setenv("KEEL_CONFIG_DIR", str(tmp_path / "another-user"))
    refused(capsys, "data.source", EVAL[0], run, *EVAL[1:])
    monkeypatch.setenv("KEEL_TRUST_CONFIG", "1")  # the explicit trust flag: the same command now runs
    assert main([EVAL[0], str(run), *EVAL[1:]]) == 0


def test_a_run_keel_wrote_for_this_user_is_trusted(run):
    assert main([EVAL[0], str(run), *EVAL[1:]]) == 0


def test_a_downloaded_run_cannot_resume_from_paths_outside_it(run, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KEEL_CONFIG_DIR", str(tmp_path / "another-user"))
    refused(capsys, "data.source", "train", f"resume={run}", "run.steps=3", "run.progress=false")


@pytest.mark.slow  # over a second in tests/durations.json
def test_trust_config_flag_trusts_for_that_command_only(run, tmp_path, monkeypatch, capsys):
    """--trust-config is KEEL_TRUST_CONFIG=1 for one invocation: eval and a resume follow the downloaded run's
    paths with it, and a command without it is refused again. A resume rewrites config.yaml, signed for this
    user: the user trusted it, and the run is now theirs."""
    monkeypatch.setenv("KEEL_CONFIG_DIR", str(tmp_path / "another-user"))
    monkeypatch.delenv("KEEL_TRUST_CONFIG", raising=False)
    assert main([EVAL[0], str(run), *EVAL[1:], "--trust-config"]) == 0
    refused(capsys, "data.source", EVAL[0], run, *EVAL[1:])
    refused(capsys, "data.source", "train", f"resume={run}", "run.steps=3", "run.progress=false")
    assert main(["train", f"resume={run}", "run.steps=3", "run.progress=false", "--trust-config"]) == 0
    assert main([EVAL[0], str(run), *EVAL[1:]]) == 0  # signed by the resume
    refused(capsys, "--trust-config", "train", "--preset", "tiny", "--trust-config")  # a new run: nothing to trust


def test_a_device_as_data_source_is_refused_before_reading(run, monkeypatch, capsys):
    monkeypatch.setenv("KEEL_TRUST_CONFIG", "1")  # even a trusted config: /dev/zero never ends
    edit_config(run, data__source="/dev/zero")
    assert "not a regular file" in refused(capsys, "/dev/zero", EVAL[0], run, *EVAL[1:])


def test_a_fifo_as_data_source_does_not_hang(run, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KEEL_TRUST_CONFIG", "1")
    fifo = tmp_path / "corpus.txt"
    os.mkfifo(fifo)
    edit_config(run, data__source=str(fifo))
    refused(capsys, "corpus.txt", EVAL[0], run, *EVAL[1:])


@pytest.mark.parametrize("command", [EVAL, ("generate", "--max-new-tokens", "2"), ("export-hf", "OUT")])
@pytest.mark.parametrize("field, value", [("d_model", 65536), ("max_seq_len", 10**12), ("d_model", 128)])
def test_model_sizes_are_checked_before_anything_is_allocated(run, tmp_path, monkeypatch, command, field, value,
                                                              capsys):
    """65536 and 10**12 would take terabytes; 128 fits in memory but not the checkpoint's (.., 64) weights.
    Checked whatever the trust: a trusted config is still checked against its checkpoint."""
    if command[0] == "export-hf":
        pytest.importorskip("transformers")
    monkeypatch.setenv("KEEL_TRUST_CONFIG", "1")
    edit_config(run, **{f"model__{field}": value})
    argv = [tmp_path / "out" if a == "OUT" else a for a in command[1:]]
    line = refused(capsys, "config.yaml", command[0], run, *argv)
    assert f"model.{field}" in line or f"ModelConfig.{field}" in line or "shape" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field, value, needle", [("max_seq_len", 10**12, "ModelConfig.max_seq_len"),
                                                   ("d_model", 128, "shape")])
def test_a_resume_checks_model_sizes_as_eval_does(run, monkeypatch, field, value, needle, capsys):
    """model.max_seq_len=10**12 was an allocator RuntimeError traceback (4 TB of RoPE tables); d_model=128 was
    refused only after the data was prepared and a model built. Both now before the trainer starts."""
    monkeypatch.setenv("KEEL_TRUST_CONFIG", "1")
    edit_config(run, **{f"model__{field}": value})
    line = refused(capsys, needle, "train", f"resume={run}", "run.steps=3", "run.progress=false")
    assert "config.yaml" in line
    assert not (run / "checkpoints" / "step_00000003").exists()


@pytest.mark.slow  # a subprocess with its own imports, several seconds
def test_a_fifo_as_data_tokenizer_does_not_hang(tmp_path):
    """Tokenizer.from_file waited on the FIFO for ever (SIGTERM could not stop it): one line naming the field."""
    import subprocess
    import sys

    fifo = tmp_path / "tokenizer.json"
    os.mkfifo(fifo)
    out = subprocess.run([sys.executable, "-m", "keel.cli", "train", "--preset", "tiny", f"data.tokenizer={fifo}",
                          f"run.out_dir={tmp_path / 'runs'}", "run.steps=1"], capture_output=True, text=True,
                         timeout=60)  # subprocess.run kills it at the deadline: a hang fails, not stalls
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "data.tokenizer" in out.stderr and "not a regular file" in out.stderr


# ---- 2. keel import-hf reads its directory as the run-directory readers do -----------------------------------
@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> Path:
    """A tiny Llama saved by transformers, with a BPE tokenizer.json."""
    transformers = pytest.importorskip("transformers")
    from keel.data.tokenizer import train_bpe

    path = tmp_path_factory.mktemp("hf") / "llama"
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    train_bpe(["def f(x):\n    return x + 1\n" * 50], 300, path / "tokenizer.json")
    return path


@pytest.fixture
def hf(hf_model, tmp_path) -> Path:
    copy = tmp_path / "in" / "llama"
    shutil.copytree(hf_model, copy)
    return copy


def set_hf_config(hf: Path, value) -> None:
    (hf / "config.json").write_text(value if isinstance(value, str) else json.dumps(value))


def hf_config(hf: Path) -> dict:
    return json.loads((hf / "config.json").read_text())


def test_an_intact_hf_directory_imports(hf, tmp_path):
    assert main(["import-hf", str(hf), str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "config.yaml").is_file()


@pytest.mark.parametrize("damage, needle", [
    (lambda c: [c], "holds a JSON list"),
    (lambda c: c | {"num_attention_heads": 0}, "num_attention_heads=0"),
    (lambda c: c | {"num_hidden_layers": "2"}, "num_hidden_layers=2; allowed: an integer"),
    (lambda c: c | {"vocab_size": 2**31}, "vocab_size=2147483648"),
    (lambda c: c | {"max_position_embeddings": 10**15}, "max_position_embeddings=1000000000000000"),
    (lambda c: "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    (lambda c: c | {"rope_parameters": ["not", "an", "object"]}, "rope_parameters=['not', 'an', 'object']"),
])
def test_a_bad_hf_config_is_one_line(hf, tmp_path, damage, needle, capsys):
    set_hf_config(hf, damage(hf_config(hf)))
    assert needle in refused(capsys, "config.json", "import-hf", hf, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_fifo_hf_config_does_not_hang(hf, tmp_path, capsys):
    (hf / "config.json").unlink()
    os.mkfifo(hf / "config.json")
    assert "not a regular file" in refused(capsys, "config.json", "import-hf", hf, tmp_path / "run")


def test_an_output_path_that_is_a_file_is_left_alone(hf, tmp_path, capsys):
    out = tmp_path / "run"
    out.write_bytes(b"precious\n")
    refused(capsys, "already exists", "import-hf", hf, out)
    assert out.read_bytes() == b"precious\n"


def test_an_index_pointing_outside_the_directory_is_refused(hf, tmp_path, capsys):
    """model.safetensors.index.json naming ../outside/...: the weights there are never read."""
    outside = tmp_path / "in" / "outside"
    outside.mkdir()
    (hf / "model.safetensors").rename(outside / "model.safetensors")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "../outside/model.safetensors"}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    line = refused(capsys, "model.safetensors.index.json", "import-hf", hf, tmp_path / "run")
    assert "../outside/model.safetensors" in line and "refused" in line
    assert not (tmp_path / "run").exists()


# ---- 5. JSON from a run directory: nesting and numbers bounded on every read; every write through safe_io ------
DEEP = "[" * 100_000 + "]" * 100_000


def test_a_deeply_nested_manifest_is_a_damaged_checkpoint(run, capsys):
    (run / "checkpoints" / "step_00000002" / "manifest.json").write_text(DEEP)
    line = refused(capsys, "no intact checkpoint", EVAL[0], run, *EVAL[1:])
    assert "checkpoints" in line


@pytest.mark.parametrize("name", ["summary.json", "run.json"])
def test_deeply_nested_run_files_are_noted_not_tracebacks(run, name, capsys):
    if name == "run.json":  # read for the status of a run without a summary
        (run / "summary.json").unlink()
    (run / name).write_text(DEEP)
    assert main(["runs", str(run.parent)]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{name}: not valid JSON (nested too deeply)" in err


@pytest.mark.slow  # 1.1 CPU s in the fast tier (the plot)
def test_a_deep_or_huge_metrics_line_is_skipped_by_runs_and_plot(run, tmp_path, capsys):
    with open(run / "metrics.jsonl", "a") as f:
        f.write(DEEP + "\n" + json.dumps({"step": 10**30, "loss": 1.0}) + "\n")
    with open(run / "telemetry.jsonl", "a") as f:
        f.write(json.dumps({"step": 10**30, "grad_norm": [1.0, 2.0]}) + "\n")
    assert main(["runs", str(run.parent)]) == 0
    assert main(["plot", str(run), "--out", str(tmp_path / "c.png")]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "metrics.jsonl: skipped 2 damaged records" in err
    assert "telemetry.jsonl: skipped 1 damaged record" in err
    assert (tmp_path / "c.png").stat().st_size > 0


def test_a_deeply_nested_tokenizer_config_is_one_line(run, capsys):
    (run / "tokenizer" / "tokenizer_config.json").write_text(DEEP)
    refused(capsys, "tokenizer", "generate", run, "--max-new-tokens", "1")


def test_lm_eval_results_are_not_written_through_a_planted_link(hf_model, tmp_path, monkeypatch):
    from keel.errors import DataError
    from keel.hf import harness

    canary = tmp_path / "canary.txt"
    canary.write_bytes(b"precious\n")
    model = tmp_path / "model"
    shutil.copytree(hf_model, model)
    (model / "lm_eval-hellaswag.json").symlink_to(canary)
    monkeypatch.setattr(harness, "_evaluate", lambda *a: {"results": {"hellaswag": {"acc": 0.5}}})
    with pytest.raises(DataError, match="lm_eval-hellaswag.json: is a symbolic link"):
        harness.run_lm_eval(model, ["hellaswag"])
    assert canary.read_bytes() == b"precious\n"


# ---- 4. a checkpoint's contents after its checksums -----------------------------------------------------------
@pytest.mark.parametrize("key", ["torch_rng", "sampler"])
def test_a_rechecksummed_rng_state_of_the_wrong_length_is_refused_at_load(run, key, capsys):
    import torch

    from damage import rechecksum

    ckpt = run / "checkpoints" / "step_00000002"
    state = torch.load(ckpt / "state.pt", weights_only=True)
    short = torch.zeros(100, dtype=torch.uint8)  # the right type, the wrong length: set_state raises
    if key == "sampler":
        state["sampler"]["generator"] = short
    else:
        state[key] = short
    torch.save(state, ckpt / "state.pt")
    rechecksum(ckpt)
    line = refused(capsys, key, "train", f"resume={run}", "run.steps=3", "run.progress=false")
    assert "5056 bytes" in line


# ---- 3. a token cache with ids beyond the vocabulary ----------------------------------------------------------
def test_a_token_cache_with_ids_beyond_the_vocabulary_is_one_line(trained, run, capsys):
    import numpy as np

    cache = next((trained.parent.parent / "cache" / "shards").iterdir())
    shard = cache / "val-000000.bin"
    saved = shard.read_bytes()
    try:
        ids = np.fromfile(shard, dtype=np.uint16)
        ids[:: max(1, len(ids) // 7)] = 60_000  # the byte tokenizer has 256 ids
        ids.tofile(shard)
        line = refused(capsys, "val-000000.bin", EVAL[0], run, *EVAL[1:])
        assert "its SHA-256 is not the one manifest.json records" in line and f"delete {cache}" in line
    finally:
        shard.write_bytes(saved)  # the module's other tests share this cache


@pytest.mark.slow  # over a second in tests/durations.json
def test_ids_beyond_the_model_in_a_cache_planted_with_its_manifest_are_one_line(trained, corpus, tmp_path, capsys):
    """A cache whose manifest was rewritten to match altered shards passes the checksums; the sampler checks each
    batch it cuts, so an id beyond the model is one line naming the shards, not an IndexError inside the embedding."""
    import hashlib

    import numpy as np

    cache = tmp_path / "cache"
    shutil.copytree(trained.parent.parent / "cache", cache)
    shard_dir = next((cache / "shards").iterdir())
    n = 1 << 20
    ids = np.resize(np.fromfile(shard_dir / "train-000000.bin", dtype=np.uint16), n)
    ids[1::5] = 60_000  # the byte tokenizer's ids are < 256
    ids.tofile(shard_dir / "train-000000.bin")
    manifest = json.loads((shard_dir / "manifest.json").read_text())
    manifest["splits"]["train"]["tokens"] = n
    manifest["splits"]["train"]["shards"][0] |= {"tokens": n, "sha256": hashlib.sha256(ids.tobytes()).hexdigest()}
    (shard_dir / "manifest.json").write_text(json.dumps(manifest))
    line = refused(capsys, "train-*.bin", "train", "--preset", "tiny", f"data.source={corpus}",
                   f"data.cache_dir={cache}", f"run.out_dir={tmp_path / 'runs'}", "run.steps=2", "run.progress=false")
    assert "token id 60000" in line and "model.vocab_size" in line


def test_the_batch_check_in_the_samplers():
    import numpy as np

    from keel.data import WindowSampler, eval_batches
    from keel.errors import DataError

    tokens = np.arange(100, dtype=np.uint16)
    x, _ = WindowSampler(tokens, 8, 2, seed=0, vocab_size=100).next_batch()  # ids 0..99: all inside
    assert int(x.max()) < 100
    sampler = WindowSampler(tokens, 8, 2, seed=0, vocab_size=90, source="shard.bin")
    with pytest.raises(DataError, match="shard.bin: token id 9[0-9] is outside the model's vocabulary of 90"):
        for _ in range(50):  # 50 batches of one sampler: some window reaches ids >= 90
            sampler.next_batch()
    with pytest.raises(DataError, match="a batch: token id 9[0-9] is outside"):
        list(eval_batches(tokens, 8, 4, 100, vocab_size=90))


def test_cached_probe_items_from_a_shared_cache_are_checked(corpus, tmp_path):
    """The probes' items are cached in data.cache_dir, which may be shared: a file nested 100,000 deep was a
    RecursionError traceback, and items scoring cannot use were scored. Both are now generated again."""
    from keel.data.corpus import DataConfig
    from keel.data.tokenizer import ByteTokenizer
    from keel.evals.tasks import PROBES

    probe = next(iter(PROBES.values()))
    data = DataConfig(source=str(corpus), cache_dir=str(tmp_path / "cache"))
    items = probe.items(data, ByteTokenizer())
    path = next((tmp_path / "cache" / "evals").rglob(f"{probe.name}-v*.jsonl"))
    for damage in ("[" * 100_000 + "]" * 100_000 + "\n", json.dumps({"task": probe.name, "answer": "x"}) + "\n"):
        path.write_text(damage)
        assert probe.items(data, ByteTokenizer()) == items
        assert path.read_text().count("\n") == len(items)  # written whole again


def test_a_jsonl_record_nested_100000_deep_is_one_line(tmp_path, capsys):
    source = tmp_path / "data.jsonl"
    source.write_text('{"text": "fine"}\n' + '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    line = refused(capsys, "data.jsonl:2", "tokenizer", f"data.source={source}", "--out", tmp_path / "tok.json",
                   f"data.cache_dir={tmp_path / 'cache'}")
    assert "nested too deeply" in line


# ---- 5. a FIFO named like the next checkpoint ------------------------------------------------------------------
@pytest.mark.slow  # a subprocess with its own imports, several seconds
def test_a_fifo_named_like_the_next_checkpoint_does_not_hang_resume(run):
    import subprocess
    import sys

    os.mkfifo(run / "checkpoints" / "step_00000004")
    # a subprocess with a deadline: a hang fails the test instead of stalling the suite
    out = subprocess.run([sys.executable, "-m", "keel.cli", "train", f"resume={run}", "run.steps=4",
                          "run.ckpt_every=2", "run.progress=false"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert (run / "checkpoints" / "step_00000004" / "manifest.json").is_file()


def test_eval_refuses_token_ids_beyond_the_models_vocabulary_in_one_line():
    """keel.train.evaluate checks each batch's ids against model.config.vocab_size: an id from a cache made for
    another vocabulary is one DataError naming the tokens, not an IndexError from the embedding."""
    import numpy as np
    import torch

    from keel.errors import DataError
    from keel.model import ModelConfig, TransformerLM
    from keel.train.evaluate import evaluate

    model = TransformerLM(ModelConfig(vocab_size=256, d_model=32, n_blocks=1, n_heads=2, max_seq_len=16))
    tokens = np.arange(200, dtype=np.uint16) % 256
    assert evaluate(model, tokens, 16, 2, 2, torch.device("cpu"))["val_loss"] > 0  # in range: evaluated
    tokens[5] = 300  # inside the first window
    with pytest.raises(DataError, match="token id 300 is outside the model's vocabulary of 256"):
        evaluate(model, tokens, 16, 2, 2, torch.device("cpu"))


def test_a_checkpoint_pruned_while_being_read_is_read_again_from_the_newest(make_run, tmp_path, monkeypatch):
    """A run still training prunes its oldest checkpoint (run.keep_checkpoints); a reader that chose it
    takes the newest again, and says so in one line if it keeps losing the race."""
    import shutil

    from keel.errors import CheckpointError
    from keel.runs import checkpoint
    from keel.runs.run_dir import RunDir

    model = make_run(tmp_path / "run")
    checkpoint.save(tmp_path / "run", 8, model, {}, {}, keep=2)  # two checkpoints: 7 and 8
    run = RunDir(tmp_path / "run")
    real_load, calls = checkpoint.load, []

    def pruned_on_first_read(path, model):  # the trainer deletes the checkpoint between choice and read
        calls.append(path)
        if len(calls) == 1:
            shutil.rmtree(path)
        return real_load(path, model)

    before = run.checkpoints()
    assert len(before) >= 2
    monkeypatch.setattr(checkpoint, "load", pruned_on_first_read)
    _, _, _, path = run.load_model()
    assert calls[0] == before[-1] and path == run.checkpoints()[-1] == before[-2]

    def always_pruned(path, model):  # the trainer writes the next checkpoint and prunes this one, every time
        step = int(path.name.split("_")[1])
        checkpoint.save(tmp_path / "run", step + 1, model, {}, {}, keep=3)
        shutil.rmtree(path)
        return real_load(path, model)
    monkeypatch.setattr(checkpoint, "load", always_pruned)
    with pytest.raises(CheckpointError, match="removed while being read"):
        run.load_model()
