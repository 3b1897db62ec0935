"""lm-eval offline: a Hub that does not answer makes the process offline at once (one line, not a minute of
retries), one that answers leaves it online, a chosen HF_HUB_OFFLINE is left alone; a task that cannot be
fetched offline is one line naming it."""

import os
import subprocess
import sys

import pytest

from keel.cli import main


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

    from keel.data.hub import hub_offline_unless_reachable

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

    from keel.data.hub import hub_offline_unless_reachable

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

    from keel.data.hub import hub_offline_unless_reachable

    def no_network(*args, **kwargs):
        raise AssertionError("asked the network")
    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    for value in ("1", "0"):
        monkeypatch.setenv("HF_HUB_OFFLINE", value)
        assert hub_offline_unless_reachable() is None and os.environ["HF_HUB_OFFLINE"] == value


@pytest.mark.slow
def test_lm_eval_offline_without_the_variable_is_one_line_and_no_retries(tmp_path, no_curves):
    """keel lm-eval with the probe first (as cmd_lm_eval calls it), HF_HUB_OFFLINE unset and a Hub that refuses
    connections: exit 2, one error line naming the task that cannot be fetched offline and --include-path, no
    "Retrying" lines (before: ten of them and 35 s to 55 s). cmd_lm_eval's own probe then finds HF_HUB_OFFLINE set
    and leaves it alone, so this process also runs the path of a user who set HF_HUB_OFFLINE=1 (one lm-eval process
    for both: its imports are most of the cost)."""
    pytest.importorskip("lm_eval")
    assert main(["train", "--preset", "tiny", "run.steps=1", "run.eval_every=0", "run.progress=false",
                 f"run.out_dir={tmp_path}", "run.name=r"]) == 0
    endpoint, stop = _server(200)
    stop()
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env |= {"HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1"}
    code = ("import sys\nfrom keel.data.hub import hub_offline_unless_reachable\nhub_offline_unless_reachable()\n"
            "from keel.cli import main\nsys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "lm-eval", str(tmp_path / "r"), "--tasks", "hellaswag",
                           "--limit", "1", "--device", "cpu"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("keel: error:")]
    assert len(errors) == 1 and "'hellaswag'" in errors[0] and "--include-path" in errors[0], proc.stderr[-3000:]
    assert "Retrying" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "Writing model shards" not in proc.stderr + proc.stdout  # transformers' own bars stay quiet


def test_fetch_failure_is_found_through_the_exception_chain():
    from keel.evals.in_memory_lm import fetch_failure

    class OfflineModeIsEnabled(Exception):
        pass

    try:
        try:
            raise OfflineModeIsEnabled("offline")
        except OfflineModeIsEnabled:
            raise RuntimeError("while loading the dataset")  # noqa: B904 (the implicit chain is the point)
    except RuntimeError as err:
        assert fetch_failure(err) == "offline"
    assert fetch_failure(ValueError("a bug")) is None
