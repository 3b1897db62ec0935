"""The documentation's code, run as written: every ```python and ```bash block of README.md and docs/*.md, a page's
blocks in order in one fresh directory, as a reader follows the page (a block is skipped with the reason its
`<!-- not run: ... -->` line gives); the README's Python API checked against independent numbers; the lm-eval
task YAML of docs/ecosystem.md."""

import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
ECOSYSTEM = ROOT / "docs" / "ecosystem.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]

RUNNERS = {"python": ["python"], "bash": ["bash", "-euo", "pipefail"]}  # fences that are run
NOT_RUN = {"yaml", "json", ""}  # fences that are data or output: never run
MARKER = re.compile(r"<!-- not run: (\S.*?) -->")
TIMEOUT_S = 300


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    not_run: str | None  # the reason given on the line before the fence, if any

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def fenced_blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file, with the `<!-- not run: reason -->` line just before it, if any."""
    lines = path.read_text().splitlines()
    blocks, start = [], None
    for i, line in enumerate(lines):
        if start is None and line.startswith("```"):
            start, lang = i, line[3:].strip()
        elif start is not None and line.strip() == "```":
            marker = MARKER.fullmatch(lines[start - 1].strip()) if start else None
            blocks.append(Block(path, start + 1, lang, "\n".join(lines[start + 1:i]) + "\n",
                                marker[1] if marker else None))
            start = None
    assert start is None, f"{path}:{start + 1}: a fence that is never closed"
    return blocks


def run_block(block: Block, cwd: Path, server: tuple[Path, Path] | None = None) -> subprocess.CompletedProcess:
    """The block as a script in `cwd`, with this interpreter's `keel`/`torchrun` first on PATH, offline; with a
    `server` (keel_server below: its clients' folder and socket), `keel` and a Python block's interpreter are its
    clients."""
    script = cwd / ("block.py" if block.lang == "python" else "block.sh")
    script.write_text(block.code)
    argv = [*RUNNERS[block.lang], script.name]
    if argv[0] == "python":
        argv[0] = sys.executable if server is None else str(server[0] / "python-block")
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = os.environ | {"PATH": path, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "MPLBACKEND": "Agg",
                        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if server is not None:
        env |= {"PATH": f"{server[0]}{os.pathsep}{path}", "KEEL_DOCS_SERVER": str(server[1])}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


# ---- `keel` in a page's shell blocks: forked from one interpreter that has imported what the commands import ----
# Each `keel` command of a page is otherwise a fresh interpreter paying 2 to 4 CPU seconds of imports (torch,
# dynamo, matplotlib) before a tiny run of about one. For a page's blocks, `keel` on PATH is a small client
# (CLIENT): it hands its arguments, working directory, environment and standard streams to a server started
# with the blocks' environment, which forks and runs keel.cli.main() there, as the console script does
# (`sys.exit(main())`), and answers with its exit status. What a fresh process would read from the environment
# as torch loads (OMP_NUM_THREADS, OMP_WAIT_POLICY, MPLBACKEND) is the server's, which is the blocks' own: the
# pages set none. A ```python block is served the same way (the client `python-block`): the forked child runs the
# script as `python block.py` would, as __main__ with its folder first on sys.path. The installed console script and
# a fresh interpreter are run by test_a_block_that_drifted_fails (no server).
CLIENT = """\
import json, os, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(os.environ["KEEL_DOCS_SERVER"])
request = json.dumps({"mode": os.path.basename(sys.argv[0]), "argv": sys.argv[1:], "cwd": os.getcwd(),
                      "env": dict(os.environ)}).encode()
socket.send_fds(s, [request], [0, 1, 2])
s.shutdown(socket.SHUT_WR)
reply = b"".join(iter(lambda: s.recv(64), b""))
sys.exit(int(reply) if reply else 70)  # no reply: the forked command died without a status
"""
PREIMPORT = ("keel.cli", "keel.train.trainer", "keel.train.evaluate", "keel.reporting.plan", "keel.reporting.plot",
             "keel.reporting.tables", "keel.generate", "keel.runs.run_dir")


def serve(path: str) -> None:
    """The server: import what the commands import, then fork one child per client; runs until killed."""
    import importlib
    import socket

    from keel.launch import launcher_environment

    launcher_environment()  # as keel.cli.main does, before torch loads
    for module in PREIMPORT:
        importlib.import_module(module)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path + ".new")
    listener.listen()
    os.rename(path + ".new", path)  # the client's socket exists only once it listens
    while True:
        conn, _ = listener.accept()
        data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        while chunk := conn.recv(1 << 16):
            data += chunk
        request = json.loads(data)
        if os.fork() == 0:  # the command; this process ends here whatever happens
            rc = 70
            try:
                listener.close()
                rc = _command(request, fds)
                conn.sendall(str(rc).encode())
            finally:
                os._exit(rc)
        conn.close()
        for fd in fds:
            os.close(fd)
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass


def _command(request: dict, fds: list[int]) -> int:
    """In the forked child: the client's streams, directory, environment and arguments, then the console script's
    `sys.exit(main())` (client `keel`) or the script as __main__ (client `python-block`); returns the exit status
    the interpreter would give."""
    import runpy
    import traceback

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    try:
        if request["mode"] == "python-block":  # `python SCRIPT ARGS...`: its folder first on the path
            sys.argv = list(request["argv"])
            sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
            runpy.run_path(sys.argv[0], run_name="__main__")
            sys.exit(0)
        sys.argv = ["keel", *request["argv"]]
        sys.exit(sys.modules["keel.cli"].main())
    except SystemExit as stop:  # as the interpreter turns sys.exit's argument into a status
        code = stop.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
        rc = 0 if code is None else code if isinstance(code, int) else 1
    except BaseException:
        traceback.print_exc()
        rc = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    return rc


@contextmanager
def keel_server(directory: Path):
    """A server for one page's blocks (in their environment); yields its `keel` client's folder and its socket."""
    bin_dir, log = directory / "bin", directory / "keel-server.log"
    bin_dir.mkdir()
    for client in ("keel", "python-block"):  # one client, told apart by its name
        (bin_dir / client).write_text(f"#!{sys.executable} -S\n{CLIENT}")
        (bin_dir / client).chmod(0o755)
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "MPLBACKEND": "Agg",
                        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with tempfile.TemporaryDirectory(prefix="keel-") as short, log.open("w") as err:  # a socket path: < 108 bytes
        socket_path = Path(short) / "sock"
        code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_readme_code as t; "
                f"t.serve({str(socket_path)!r})")
        server = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + TIMEOUT_S
            while not socket_path.exists():  # it appears once the server listens
                assert server.poll() is None, f"the keel server ended: {log.read_text()[-3000:]}"
                assert time.monotonic() < deadline, "the keel server did not start"
                time.sleep(0.05)
            yield bin_dir, socket_path
        finally:
            server.kill()
            server.wait()


def _page(path: Path):
    blocks = [b for b in fenced_blocks(path) if b.lang in RUNNERS]
    marks = [pytest.mark.slow] + ([pytest.mark.distributed] if any("torchrun" in b.code for b in blocks) else [])
    return pytest.param(path, marks=marks, id=str(path.relative_to(ROOT)))


@pytest.mark.parametrize("page", [_page(p) for p in DOCS if any(b.lang in RUNNERS for b in fenced_blocks(p))])
def test_every_page_runs_in_order_as_written(page, tmp_path):
    """A page's blocks one after the other in one empty directory, as a reader pastes them going down the page
    (a later block may use what an earlier one made; none may trip over it); a block with a `not run` line is
    passed over, its reason printed."""
    work = tmp_path / "page"
    work.mkdir()
    with ExitStack() as stack:
        server = None
        for block in (b for b in fenced_blocks(page) if b.lang in RUNNERS):
            if block.not_run:
                print(f"{block.where}: not run: {block.not_run}")
                continue
            if server is None and (block.lang == "python" or re.search(r"^keel ", block.code, flags=re.M)):
                server = stack.enter_context(keel_server(tmp_path))
            proc = run_block(block, work, server)
            assert proc.returncode == 0, (f"{block.where} ({block.lang}) exited {proc.returncode}, after the "
                                          f"page's blocks above it:\n{block.code}\n--- stdout ---\n"
                                          f"{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}")


def test_every_block_is_run_or_says_why_not():
    """Every fence is a language the test runs, or data/output; every `not run` line has a reason and sits just
    before a block the test would run (a stray or misspelt marker must not silently do nothing)."""
    blocks = [b for path in DOCS for b in fenced_blocks(path)]
    unknown = [f"{b.where}: ```{b.lang}" for b in blocks if b.lang not in RUNNERS and b.lang not in NOT_RUN]
    assert not unknown, f"run these or list the language in NOT_RUN: {unknown}"
    fences = {(b.path, b.line) for b in blocks if b.lang in RUNNERS}
    for path in DOCS:
        for i, line in enumerate(path.read_text().splitlines(), start=1):
            if line.startswith("<!-- not run"):
                assert MARKER.fullmatch(line.strip()), f"{path.name}:{i}: write `<!-- not run: <reason> -->`"
                assert (path, i + 1) in fences, f"{path.name}:{i}: a `not run` line must directly precede a block"
    runnable = [b for b in blocks if b.lang in RUNNERS and not b.not_run]
    assert {b.lang for b in runnable if b.path == README} == set(RUNNERS)  # the front page's code runs


def test_a_block_that_drifted_fails(tmp_path):
    """The runner sees failures: a Python name the library no longer has, and a keel option it refuses."""
    for lang, code in (("python", "import keel\nkeel.no_such_function()\n"),
                       ("bash", "keel train --preset tiny run.no_such_field=1\necho not reached\n")):
        proc = run_block(Block(README, 0, lang, code, None), tmp_path)
        assert proc.returncode != 0 and "not reached" not in proc.stdout, (lang, proc.stdout, proc.stderr)


@pytest.mark.slow  # a server importing torch
def test_keel_through_the_server_answers_as_the_console_script(tmp_path):
    """The pages' `keel` and Python blocks (clients of keel_server) exit, print and fail as the installed command
    and a fresh interpreter do: a refused option stops the block with the command's one error line, output reaches
    a pipe; a script runs as __main__ beside its folder's modules, its exception's last line and exit status and
    its sys.exit code are the interpreter's."""
    blocks = {"refused": ("bash", "keel train --preset tiny run.no_such_field=1\necho not reached\n"),
              "version": ("bash", "keel --version | tr a-z A-Z\n"),
              "missing": ("bash", "keel eval no-such-run-dir\n"),
              "script": ("python", "import os, sys\nimport helper\nprint(__name__, os.path.basename(sys.argv[0]), "
                                   "helper.X, os.path.basename(os.getcwd()), os.environ['HF_HUB_OFFLINE'])\n"),
              "raises": ("python", "print('before', flush=True)\nraise ValueError('from the block')\n"),
              "exits": ("python", "import sys\nprint('out')\nsys.exit(3)\n")}
    work = tmp_path / "work"
    work.mkdir()
    (work / "helper.py").write_text("X = 'imported beside the script'\n")  # the script's folder is on its path
    real = {name: run_block(Block(README, 0, lang, code, None), work) for name, (lang, code) in blocks.items()}
    with keel_server(tmp_path) as server:
        served = {name: run_block(Block(README, 0, lang, code, None), work, server)
                  for name, (lang, code) in blocks.items()}
    for name in blocks:
        assert (served[name].returncode, served[name].stdout) == (real[name].returncode, real[name].stdout), name
        assert served[name].stderr.splitlines()[-1:] == real[name].stderr.splitlines()[-1:], name
    assert real["refused"].returncode == 2 and "no_such_field" in real["refused"].stderr
    assert real["version"].stdout.startswith("KEEL ") and real["missing"].returncode == 2
    assert real["script"].stdout == "__main__ block.py imported beside the script work 1\n"
    assert (real["raises"].returncode, real["raises"].stdout) == (1, "before\n")
    assert real["raises"].stderr.splitlines()[-1] == "ValueError: from the block"
    assert (real["exits"].returncode, real["exits"].stdout) == (3, "out\n")


# ---- the README's Python API, checked against independent numbers ---------------------------------------
def library_blocks() -> list[str]:
    """The ```python blocks of the README's "Python API" section: the model, then train/eval/generate."""
    section = README.read_text().split("## Python API", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 2, "expected two Python blocks under 'Python API'"
    return blocks


def library_code() -> str:
    return library_blocks()[0]


@pytest.mark.slow  # 10 steps of the README's model; the next test keeps the Python API in the fast tier
def test_readme_library_example_trains_a_next_token_model():
    """Its loss is the next-token loss (the cross-entropy written out: minus the log-softmax at each next token),
    and 10 AdamW steps of the README's own call on its one batch lower it (5.6 to 1.8 nats when measured; 30 steps
    at a third of the rate reached 1.2 at three times the cost), though a next-token model cannot copy random
    tokens from its input."""
    torch.manual_seed(0)
    code = library_code()
    ns: dict = {}
    exec(compile(code, str(README), "exec"), ns)
    model, idx = ns["model"], ns["idx"]
    assert idx.shape[1] >= 2
    call = next(line.split("#")[0] for line in code.splitlines() if "loss = model(" in line)
    with torch.no_grad():
        logits, _ = model(idx[:, :-1])
        log_p = torch.log_softmax(logits.double(), dim=-1)  # position t predicts token t + 1
        expected = -log_p.gather(-1, idx[:, 1:, None]).mean()
    assert abs(ns["loss"].item() - expected.item()) < 1e-5, (ns["loss"], expected)
    start = ns["loss"].item()
    assert abs(start - math.log(ns["config"].vocab_size)) < 1.0  # starts near uniform

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(10):
        exec(call, ns)
        ns["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    exec(call, ns)
    assert 0.5 < ns["loss"].item() < start - 2.0  # it learns the batch, but cannot copy the next token


@pytest.mark.slow  # over a second in tests/durations.json
def test_readme_train_evaluate_generate_from_python(tmp_path, monkeypatch, no_curves):
    """The second block, alone, trains a run into ./runs, evaluates it and samples from it: the same numbers the
    run's own summary and a next-token evaluation of the saved model give."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    threads = torch.get_num_threads()
    ns: dict = {}
    try:
        exec(compile(library_blocks()[1], str(README), "exec"), ns)  # alone: it imports what it uses
    finally:
        torch.set_num_threads(threads)
    summary, result, run_dir = ns["summary"], ns["result"], Path(ns["trainer"].run_dir)
    assert run_dir.resolve().parent == tmp_path.resolve() / "runs"
    assert summary["steps"] == 20 and not summary["interrupted"]
    assert json.loads((run_dir / "summary.json").read_text())["final_val_loss"] == summary["final_val_loss"]
    assert result["val_loss"] == pytest.approx(summary["final_val_loss"], rel=1e-5)  # same split, same batches
    text, tokenizer = ns["text"], ns["tokenizer"]
    assert text.startswith("def ") and len(tokenizer.encode(text)) == len(tokenizer.encode("def ")) + 20


def _ecosystem_block(after: str, lang: str) -> str:
    section = ECOSYSTEM.read_text().split(after, 1)[1]
    return re.search(rf"```{lang}\n(.*?)```", section, flags=re.S)[1]


@pytest.mark.slow
def test_readme_lm_eval_task_yaml_runs_offline(tmp_path, monkeypatch, capsys, no_curves):
    """docs/ecosystem.md's task YAML and data lines, written where it says, score with `keel lm-eval` offline."""
    pytest.importorskip("lm_eval")
    from keel.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    yaml_text = _ecosystem_block("A task of your own reads", "yaml")
    path = yaml_text.splitlines()[0].removeprefix("# ").strip()
    (tmp_path / path).parent.mkdir(parents=True)
    (tmp_path / path).write_text(yaml_text)
    data = _ecosystem_block(path.split("/")[0] + "/", "json")
    assert all(json.loads(line) for line in data.splitlines())
    (tmp_path / "my_tasks" / "my_task.jsonl").write_text(data)
    assert main(["train", "--preset", "tiny", "run.steps=2", "run.eval_every=0", "run.out_dir=runs",
                 "run.name=r"]) == 0
    capsys.readouterr()
    assert main(["lm-eval", "runs/r", "--tasks", "my_task", "--include-path", "my_tasks", "--device", "cpu"]) == 0
    results = json.loads((tmp_path / "runs" / "r" / "lm_eval-my_task.json").read_text())["results"]["my_task"]
    assert 0 <= results["acc,none"] <= 1


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_of_the_docs_resolves():
    """The front page and docs/ link to each other by file and heading; a moved section must not leave a dead
    link behind."""
    dead = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists():
                dead.append(f"{path.name}: {target}")
            elif anchor and linked.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.M)
                if anchor not in {_anchor(h) for h in headings}:
                    dead.append(f"{path.name}: {target}")
    assert not dead, dead


def test_every_page_an_error_message_names_holds_that_section():
    """Messages point to the page that holds the answer: every `docs/<page>.md[#heading]` in the package's
    strings names a page and heading that exist, and none sends the reader to a README section."""
    source = "\n".join(p.read_text() for p in (ROOT / "src" / "keel").rglob("*.py"))
    named = set(re.findall(r"docs/([\w-]+\.md)(?:#([\w-]+))?", source))
    assert named, "no docs/ page named in the package"
    dead = []
    for page, anchor in sorted(named):
        path = ROOT / "docs" / page
        text = path.read_text() if path.exists() else ""
        if not path.exists() or (anchor and anchor not in {_anchor(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}):
            dead.append(f"docs/{page}#{anchor}")
    assert dead == []
    assert not re.search(r"README's [\w -]+ section", source)


def test_the_front_page_decides_in_one_screen():
    """The pitch, a decision table in words (at most 6 rows, no p-value: those live in results/, each row linked to
    its evidence there), the equation, then the quick start before word 600 with the CPU-torch line in it."""
    text = README.read_text()
    before = text[:text.index("## Quick start")]
    assert len(before.split()) < 600
    section = before.split("## Which scheme to use", 1)[1].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("| ")][2:]
    assert 3 <= len(table) <= 6
    assert all("](results/" in row for row in table), table
    assert not re.search(r"\bp ?[=<]|Holm", before)
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "--index-url https://download.pytorch.org/whl/cpu" in quick and "-c constraints.txt" in quick