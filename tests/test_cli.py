"""The `keel` command as a user types it."""

import subprocess
import sys

import pytest

from keel.cli import main


def test_summary_reports_blocks_and_sublayers(capsys):
    assert main(["summary", "--preset", "tiny", "n_blocks=3", "scheme=keel", "alpha=sqrtL"]) == 0
    out = capsys.readouterr().out
    assert "depth: 6 sub-layers (the paper's L; model.n_blocks = 3 blocks)" in out
    assert "alpha=2.44949" in out


@pytest.mark.parametrize("depth", ["model.n_sublayers=6", "n_sublayers=6"])
def test_depth_in_sublayers_is_the_named_block_count_halved(depth, capsys):
    """Every command counts depth in sub-layers (presets, bench --depths, studies' depths); model.n_sublayers=6 is
    model.n_blocks=3, alpha = L = 6 with it."""
    assert main(["summary", "--preset", "tiny", depth]) == 0
    out = capsys.readouterr().out
    assert "depth: 6 sub-layers (the paper's L; model.n_blocks = 3 blocks)" in out and "alpha = L = 6" in out


@pytest.mark.parametrize("value", ["7", "0", "-2", "x", "1e9x"])
def test_an_odd_or_bad_sublayer_count_is_one_line(value, capsys):
    assert main(["summary", "--preset", "tiny", f"model.n_sublayers={value}"]) == 2
    err = capsys.readouterr().err
    assert "model.n_sublayers: got" in err and "an even number >= 2" in err and err.count("\n") == 1


def test_bad_override_names_the_field(capsys):
    assert main(["summary", "scheme=pre_ln", "alpha=4"]) == 2
    err = capsys.readouterr().err
    assert "ModelConfig.alpha" in err and err.count("\n") == 1
    assert main(["summary", "n_layers=4"]) == 2
    assert "n_layers" in capsys.readouterr().err


@pytest.mark.slow
def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "keel.cli", "summary", "--preset", "tiny"],
                         capture_output=True, text=True, check=True).stdout
    assert "parameters:" in out


@pytest.mark.slow  # a Python process importing torch
def test_a_reader_that_closes_the_pipe_early_gets_no_traceback():
    # `keel summary | head -1`: the reader is gone before keel prints, as with head on a long table
    proc = subprocess.Popen([sys.executable, "-m", "keel.cli", "summary", "--preset", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait() == 141 and "Traceback" not in err and "BrokenPipe" not in err


def test_a_signal_that_surfaces_as_another_exception_is_still_one_line_and_exit_130(capsys):
    # SIGTERM landing inside a class body's __set_name__ (triton's import) comes out as a RuntimeError whose cause is
    # the handler's KeyboardInterrupt: still an interruption. Without a signal the same error is an error.
    import signal

    from keel import runtime
    from keel.cli.support import INTERRUPTED_EXIT, run_interruptible

    def interrupted_import():
        runtime.PENDING_SIGNALS.append(signal.SIGTERM)
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as err:
            raise RuntimeError("Error calling __set_name__ on 'cached_property' instance 'do_bench'") from err

    assert run_interruptible(interrupted_import) == INTERRUPTED_EXIT
    assert capsys.readouterr().err == "keel: interrupted\n"

    def broken():
        raise RuntimeError("a real error")

    with pytest.raises(RuntimeError, match="a real error"):
        run_interruptible(broken)


@pytest.mark.slow
def test_a_model_no_device_holds_is_refused_naming_the_model_not_the_batch(tmp_path, capsys, monkeypatch):
    """keel train: weights, gradients and AdamW state alone of ~2.7T parameters exceed any machine, so the
    memory plan names the model's size (was: "lower run.batch_size"), before anything is built or written."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--preset", "tiny", "model.n_blocks=65536", "model.d_model=4096", "model.n_heads=32",
                 "model.n_kv_heads=8"]) == 2
    err = capsys.readouterr().err
    assert "model.n_blocks, model.d_model: the model's weights, gradients and optimizer state alone" in err
    assert err.count("\n") == 1 and not any((tmp_path / "runs").glob("*"))  # no run directory made
