"""Bad input, as a careless or hostile user types it: one line naming the field or file, exit 2, nothing written."""

import pytest

from keel.cli import main


def one_line_error(capsys, needle: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("keel: error: ") and needle in err[0], err
    return err[0]


@pytest.mark.parametrize("overrides,needle", [
    (["run.name=a\x01b"], "run.name"),
    (["run.name=../elsewhere"], "run.name"),
    (["run.batch_size=10000000"], "run.batch_size"),
    (["optim.beta1=2"], "optim.beta1"),
    (["optim.lr=inf"], "optim.lr"),
    (["optim.weight_decay=-1"], "optim.weight_decay"),
    (["guard.spike_window=-1"], "guard.spike_window"),
    (["guard.spike_window=0"], "guard.spike_window"),
    (["guard.spike_min_history=-1"], "guard.spike_min_history"),
    (["guard.spike_min_rise=-0.1"], "guard.spike_min_rise"),
    ([f"run.seed={2**70}"], "run.seed"),
    (["steps=10"], "did you mean run.steps"),
    (["model.alpha=-3"], "ModelConfig.alpha"),
    # counts beyond any run: refused at once (they overflowed or ran for minutes)
    ([f"run.grad_accum={10**20}"], "run.grad_accum"),
    (["run.grad_accum=1000000000"], "run.grad_accum: got 1000000000; allowed: an integer in [1, 65,536]"),
    ([f"model.max_seq_len={10**20}"], "ModelConfig.max_seq_len"),
    ([f"guard.spike_window={10**20}"], "guard.spike_window"),
    ([f"model.n_blocks={10**20}"], "ModelConfig.n_blocks"),
    ([f"run.eval_batches={10**20}"], "run.eval_batches"),
])
def test_bad_overrides_are_refused_before_anything_is_written(overrides, needle, args, tmp_path, capsys):
    assert main(["train", "--preset", "tiny", *args(*overrides)]) == 2
    one_line_error(capsys, needle)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_config_file_interpolating_a_missing_key_is_one_line(args, tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text("run:\n  name: ${nosuch.key}\n")
    assert main(["train", "--preset", "tiny", "--config", str(tmp_path / "bad.yaml"), *args()]) == 2
    one_line_error(capsys, "Interpolation key 'nosuch.key' not found")


@pytest.mark.parametrize("text,needle", [
    (b"- a\n- b\n", "expected a mapping"),
    (b"model: 5\n", "model"),
    (b"run:\n  steps: \xff\xfe\n", "bad.yaml"),
    (b"run: [1, 2\n", "not valid YAML"),
])
def test_bad_config_files_name_the_file_or_field(text, needle, args, tmp_path, capsys):
    (tmp_path / "bad.yaml").write_bytes(text)
    assert main(["train", "--preset", "tiny", "--config", str(tmp_path / "bad.yaml"), *args()]) == 2
    one_line_error(capsys, needle)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


@pytest.mark.parametrize("flags,needle", [
    (["--top-p", "0"], "--top-p"), (["--top-p", "-1"], "--top-p"), (["--temperature", "nan"], "--temperature"),
    (["--temperature", "-1"], "--temperature"), (["--max-new-tokens", "-1"], "--max-new-tokens"),
    (["--prompt", "caf\udce9"], "--prompt"),
    # NaN probabilities in float32 (1e-308 is inf logits, or a top-p that rounds to 0), or for ever
    (["--temperature", "1e-308"], "--temperature"), (["--top-p", "1e-308"], "--top-p"),
    (["--max-new-tokens", str(10**20)], "--max-new-tokens"),
])
def test_bad_generate_flags(flags, needle, tmp_path, capsys, make_run):
    make_run(tmp_path / "run")
    assert main(["generate", str(tmp_path / "run"), *flags]) == 2
    one_line_error(capsys, needle)


def test_bad_eval_and_export_targets(tmp_path, capsys, make_run):
    make_run(tmp_path / "run")
    assert main(["eval", str(tmp_path / "run"), "--batches", "-1"]) == 2
    one_line_error(capsys, "--batches")
    (tmp_path / "file.txt").write_text("mine")
    pytest.importorskip("transformers")
    assert main(["export-hf", str(tmp_path / "run"), str(tmp_path / "file.txt")]) == 2
    one_line_error(capsys, "file.txt")
    assert main(["export-hf", str(tmp_path / "run"), str(tmp_path / "file.txt" / "sub")]) == 2
    one_line_error(capsys, "file.txt is not a directory")
    assert (tmp_path / "file.txt").read_text() == "mine"


@pytest.mark.parametrize("argv,needle", [
    (["eval", "RUN", "--device", "meta"], "--device"),  # was a RuntimeError at the first .item()
    (["tokenizer", "--vocab-size", str(10**20), "--out", "OUT/tok.json"], "--vocab-size"),
    (["lm-eval", "RUN", "--tasks", ",,,"], "--tasks"),  # was lm_eval's ValueError traceback
    (["lm-eval", "RUN", "--tasks", "hellaswag", "--limit", "-1"], "--limit"),
    (["lm-eval", "RUN", "--tasks", "hellaswag", "--batch-size", "0"], "--batch-size"),
    (["lm-eval", "RUN", "--tasks", "hellaswag", "--num-fewshot", "-1"], "--num-fewshot"),
    (["lm-eval", "RUN", "--tasks", "hellaswag", "--device", "meta"], "--device"),
    (["bench", "--steps", "-1"], "--steps"),  # was a StatisticsError traceback
    (["bench", "--steps", str(10**20)], "--steps"),  # timed for ever
    (["bench", "--warmup", "-2"], "--warmup"),
    (["train", "--preset", "tiny", "run.name=" + "a" * 300, "run.out_dir=OUT/runs"], "at most 255 bytes"),
])
def test_bad_command_line_values_are_refused_before_any_work(argv, needle, tmp_path, capsys, make_run):
    """Checked before anything is loaded or fetched (lm-eval's Hub probe included), so
    these hold whether or not the eval extra is installed."""
    make_run(tmp_path / "run")
    argv = [str(tmp_path / "run") if a == "RUN" else a.replace("OUT", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    one_line_error(capsys, needle)
    assert not (tmp_path / "tok.json").exists() and not list((tmp_path / "run").glob("lm_eval-*"))


@pytest.mark.slow  # about a second: 0.8 CPU s in the fast tier, over a second on an idle core before
def test_a_config_file_nested_100000_deep_is_one_line(args, tmp_path, capsys):
    """YAML's composer recurses once per level: was a RecursionError traceback from the --config check."""
    (tmp_path / "deep.yaml").write_text("model:\n  scheme: " + "[" * 100_000 + "]" * 100_000 + "\n")
    assert main(["train", "--preset", "tiny", "--config", str(tmp_path / "deep.yaml"), *args()]) == 2
    one_line_error(capsys, "deep.yaml: nested too deeply")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_damaged_run_config_is_blamed_on_the_file(tmp_path, capsys, make_run):
    make_run(tmp_path / "run")
    (tmp_path / "run" / "config.yaml").write_bytes(b"model:\n  d_model: [\n")
    assert main(["eval", str(tmp_path / "run")]) == 2
    one_line_error(capsys, "config.yaml: damaged run config")


def test_a_file_that_is_not_a_config_is_not_echoed_back(args, tmp_path, capsys):
    """YAML reads a passwd-like file as one long key: the error names it, shortened, not the whole file."""
    (tmp_path / "passwd").write_text("\n".join(f"user{i}:x:{i}:{i}::/home/user{i}:/bin/sh" for i in range(300)))
    assert main(["train", "--preset", "tiny", "--config", str(tmp_path / "passwd"), *args()]) == 2
    line = one_line_error(capsys, "has no field")
    assert len(line) < 250 and "user299" not in line, line


@pytest.mark.parametrize("argv", [["runs", "a\nb\x1b[2J"], ["train", "--bo\ngus\x1b]0;x\x07"],
                                  ["train", "model.n\nope\x1b=1"]])
def test_an_argument_with_control_characters_is_echoed_escaped_on_one_line(argv, capsys):
    """A newline or an escape sequence in an argument, echoed back by its error, must not split the line or
    reach the terminal raw."""
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's usage error
        code = stop.code
    assert code == 2
    line = one_line_error(capsys, "\\n")
    assert "\x1b" not in line and "\\x1b" in line, line


@pytest.mark.parametrize("case,needle", [("short validation", "run.eval_every"),
                                         ("large tokenizer", "model.vocab_size"), ("no memory", "run.batch_size"),
                                         ("no memory for the model", "model.n_blocks, model.d_model")])
def test_a_run_that_does_not_fit_its_data_or_device_is_refused_naming_the_field(case, needle, monkeypatch):
    """keel.reporting.plan.check_fits, which the trainer calls before building the model: each refusal names the
    field to change, and a run that fits passes."""
    from types import SimpleNamespace

    import torch

    from keel.config import load_config
    from keel.errors import ConfigError
    from keel.reporting import plan

    config = load_config(["model.vocab_size=256", "run.seq_len=32", "run.eval_every=10"], preset="tiny")
    data = SimpleNamespace(val=[0] * 33, tokenizer=SimpleNamespace(name="bytes", vocab_size=256))
    monkeypatch.setattr(plan, "device_memory", lambda device: None)  # an unknown amount: not checked
    plan.check_fits(config, data, 1, torch.device("cpu"))  # fits: no error
    if case == "short validation":
        data.val = [0] * 32  # one window needs seq_len + 1 tokens
    elif case == "large tokenizer":
        data.tokenizer.vocab_size = 257
    else:  # room for the model's weights, gradients and AdamW state but not the step's activations, or not even those
        states = sum(plan.memory_plan(config, 1, torch.device("cpu"))[k] for k in ("params", "grads", "optimizer"))
        room = states + 1024 if case == "no memory" else states - 1024
        monkeypatch.setattr(plan, "device_memory", lambda device: room)
    with pytest.raises(ConfigError, match=needle):
        plan.check_fits(config, data, 1, torch.device("cpu"))


def test_on_and_off_are_text_for_a_text_field_and_a_yaml_boolean_is_named(args, tmp_path, capsys):
    """YAML 1.1 reads on/off/yes/no as booleans: `run.fused_junction=off` on the command line was refused as
    'False'. Typed as an override it is the text; in a YAML file unquoted, the message says why."""
    from keel.config import load_config

    assert load_config(["run.fused_junction=off"], preset="tiny").run.fused_junction == "off"
    assert load_config(["run.fused_junction=on"], preset="tiny").run.fused_junction == "on"
    assert load_config(["run.compile=off"], preset="tiny").run.compile is False  # a boolean field stays one
    (tmp_path / "c.yaml").write_text("run:\n  fused_junction: off\n")
    assert main(["train", "--preset", "tiny", "--config", str(tmp_path / "c.yaml"), "--dry-run", *args()]) == 2
    one_line_error(capsys, "write 'off'")
