"""A user's first hour, continued: one line on Ctrl-C, the
step `keel runs` shows for an interrupted run, short runs' plots, lm-eval offline. Each test failed before the
change it covers."""

import os
import subprocess
import sys

import pytest


# ---- Ctrl-C: one line on stderr, exit 130, and the step it reached -------------------------------------
def test_ctrl_c_is_one_line_on_stderr_and_the_run_shows_the_step_it_reached(tmp_path, monkeypatch, capsys):
    """Interrupted at step 16 with a metrics record every 10 steps: one stderr line naming step 16 and the resume
    command, nothing else said, exit 130; summary, checkpoint and `steps_done` all say 16 (the last record: 10).
    Before: four lines on stdout, and `keel runs` showed 10/300."""
    import json
    import signal

    from keel.cli import main
    from keel.runs.run_dir import RunDir, steps_done
    from keel.train.trainer import Trainer

    def ctrl_c_at_16(trainer, step):  # called before step `step` + 1, which then completes
        if step == 15:
            os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C: the trainer's handler only sets its flag
    real_init = Trainer.__init__
    monkeypatch.setattr(Trainer, "__init__", lambda self, config, run_dir=None, callbacks=(): real_init(
        self, config, run_dir, [*callbacks, ctrl_c_at_16]))
    rc = main(["train", "--preset", "tiny", "run.steps=300", "run.log_every=10", "run.eval_every=0",
               "run.progress=false", f"run.out_dir={tmp_path}", "run.name=r"])
    out, err = capsys.readouterr()
    run = tmp_path / "r"
    assert rc == 130
    assert err == f"keel: interrupted at step 16; saving its checkpoint; continue with: keel train resume={run}\n"
    assert "interrupted" not in out and "checkpoint" not in out and "curves" not in out, out
    assert json.loads((run / "summary.json").read_text())["steps"] == 16
    assert sorted(p.name for p in (run / "checkpoints").iterdir())[-1] == "step_00000016"
    assert (run / "curves.png").is_file()  # still drawn, without a line
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 10 and steps_done(RunDir.open(run)) == 16
    (run / "summary.json").write_text(json.dumps({"steps": "16"}))  # not a step count: the metrics alone
    assert steps_done(RunDir.open(run)) == 10


# ---- short runs' plots ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def telemetry_run(tmp_path_factory):
    """A 6-step tiny run with telemetry at steps 2, 4 and 6."""
    from keel.cli import main

    root = tmp_path_factory.mktemp("plot")
    assert main(["train", "--preset", "tiny", "run.steps=6", "run.telemetry_every=2", "run.eval_every=0",
                 "run.progress=false", f"run.out_dir={root}", "run.name=r"]) == 0
    return root / "r"


def test_heatmap_columns_are_centred_on_their_steps(telemetry_run):
    from keel.reporting.plot import build_figure

    images = [im for ax in build_figure([telemetry_run]).axes for im in ax.images]
    assert len(images) == 3  # gradient norm, stream RMS, |F| / |alpha x|
    # three columns at steps 2, 4, 6, each 2 steps wide (before: (2, 6), steps 2 and 6 at the columns' edges)
    assert {tuple(im.get_extent()[:2]) for im in images} == {(1.0, 7.0)}


def test_a_run_with_one_telemetry_record_gets_a_line_not_a_sliver_at_step_0(telemetry_run, tmp_path):
    import shutil

    from keel.reporting.plot import build_figure

    short = tmp_path / "short"
    shutil.copytree(telemetry_run, short)
    first = (short / "telemetry.jsonl").read_text().splitlines()[0]
    (short / "telemetry.jsonl").write_text(first + "\n")
    fig = build_figure([short])
    assert [ax for ax in fig.axes if ax.images] == []
    assert ("short: one telemetry record (step 2), no heatmaps: they need two or more (run.telemetry_every at "
            "most half of run.steps)") in fig._suptitle.get_text().replace("\n", " ")
    assert all(ax.get_xlim()[0] > 0 for ax in fig.axes)  # the curves keep their own range: nothing drawn at 0


# ---- lm-eval offline: one line at once, not a minute of retries ------------------------------------------------
@pytest.fixture
def hub_online_by_default(monkeypatch):
    """HF_HUB_OFFLINE unset (conftest sets it for every test), and huggingface_hub's own flag restored after."""
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    return monkeypatch


def _server(answer: int | None):
    """A local endpoint: an HTTP server answering every request with status `answer`, or (None) a socket that
    accepts connections and never answers."""
    import http.server
    import socket
    import threading

    if answer is None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        return f"http://127.0.0.1:{sock.getsockname()[1]}", sock.close

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(answer)
            self.end_headers()

        def log_message(self, *args):
            pass
    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    # shutdown() waits for serve_forever's next poll: 0.5 s by default, a test's main cost
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server.shutdown


@pytest.mark.parametrize("answer", [200, 404, 503])
def test_a_hub_that_answers_leaves_the_process_online(hub_online_by_default, answer):
    import huggingface_hub.constants

    from keel.evals.offline import hub_offline_unless_reachable

    endpoint, stop = _server(answer)
    hub_online_by_default.setenv("HF_ENDPOINT", endpoint)
    try:
        assert hub_offline_unless_reachable() is None
    finally:
        stop()
    assert "HF_HUB_OFFLINE" not in os.environ and huggingface_hub.constants.HF_HUB_OFFLINE is False


@pytest.mark.parametrize("where", ["refused", "silent", "no such host"])
def test_a_hub_that_does_not_answer_makes_the_process_offline(hub_online_by_default, where):
    import huggingface_hub
    import huggingface_hub.constants

    from keel.evals.offline import hub_offline_unless_reachable

    stop = lambda: None  # noqa: E731
    if where == "refused":
        endpoint, stop = _server(200)
        stop()  # the port is closed again: connections are refused
    elif where == "silent":
        endpoint, stop = _server(None)
    else:
        endpoint = "http://no-such-host.invalid"  # .invalid never resolves (RFC 6761)
    hub_online_by_default.setenv("HF_ENDPOINT", endpoint)
    try:
        reason = hub_offline_unless_reachable(timeout=0.5)
    finally:
        stop()
    assert reason is not None and reason.startswith(f"{endpoint}: ")
    assert os.environ["HF_HUB_OFFLINE"] == os.environ["HF_DATASETS_OFFLINE"] == "1"
    assert huggingface_hub.is_offline_mode()  # read by huggingface_hub and transformers, imported before


def test_a_chosen_hf_hub_offline_is_left_alone_and_nothing_is_asked(monkeypatch):
    import urllib.request

    from keel.evals.offline import hub_offline_unless_reachable

    def no_network(*args, **kwargs):
        raise AssertionError("asked the network")
    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    for value in ("1", "0"):
        monkeypatch.setenv("HF_HUB_OFFLINE", value)
        assert hub_offline_unless_reachable() is None and os.environ["HF_HUB_OFFLINE"] == value


@pytest.mark.slow
def test_lm_eval_offline_without_the_variable_is_one_line_and_no_retries(tmp_path):
    """keel lm-eval with the probe first (as cmd_lm_eval calls it), HF_HUB_OFFLINE unset and a Hub that refuses
    connections: exit 2, one error line, no "Retrying" lines (before: ten of them and 35 s to 55 s)."""
    pytest.importorskip("lm_eval")
    from keel.cli import main

    assert main(["train", "--preset", "tiny", "run.steps=1", "run.eval_every=0", "run.progress=false",
                 f"run.out_dir={tmp_path}", "run.name=r"]) == 0
    endpoint, stop = _server(200)
    stop()
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env |= {"HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1"}
    code = ("import sys\nfrom keel.evals.offline import hub_offline_unless_reachable\nhub_offline_unless_reachable()\n"
            "from keel.cli import main\nsys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "lm-eval", str(tmp_path / "r"), "--tasks", "hellaswag",
                           "--limit", "1", "--device", "cpu"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("keel: error:")]
    assert len(errors) == 1 and "'hellaswag'" in errors[0], proc.stderr[-3000:]
    assert "Retrying" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
