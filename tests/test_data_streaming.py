"""data.streaming=true (keel.data.streaming): a local dataset laid out as on the Hugging Face hub (configs in its
card, JSONL shards) read as a stream; each rank's part against the documented rule, resume bit for bit (sampler,
trainer, two gloo ranks), and bad input. Nothing here reaches the network."""

from __future__ import annotations

import io
import json
import re
import shutil
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

import keel.data.streaming as streaming
from keel.cli import main
from keel.data import DataConfig, DataError, WindowSampler, prepare
from keel.data.tokenizer import train_bpe

pytestmark = pytest.mark.usefixtures("no_curves")  # none of these checks curves.png: each in-process run skips its plot

pytest.importorskip("datasets")

VAL_FRACTION = 0.1  # every 10th document of the head is held out
N_DOCS, N_FILES = 120, 4

CARD = """---
configs:
- config_name: small
  data_files:
  - split: train
    path: small/*.jsonl
- config_name: other
  data_files:
  - split: train
    path: other/*.jsonl
---
"""


def doc(i: int) -> str:
    return f"<doc {i}> " + " ".join(f"word{(i * 7 + j) % 23}" for j in range(5 + i % 11)) + "\n"


@pytest.fixture
def repo(tmp_path) -> Path:
    """A dataset folder as on the hub: config `small` in N_FILES JSONL files of consecutive documents."""
    root = tmp_path / "repo"
    for config in ("small", "other"):
        (root / config).mkdir(parents=True)
    per = N_DOCS // N_FILES
    for k in range(N_FILES):
        with open(root / "small" / f"part-{k}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": doc(i), "id": i}) + "\n" for i in range(k * per, (k + 1) * per))
    (root / "other" / "a.jsonl").write_text(json.dumps({"text": "other"}) + "\n")
    (root / "README.md").write_text(CARD)
    return root


def config(repo: Path, **fields) -> DataConfig:
    return DataConfig(**{"source": f"hf:{repo}", "hf_config": "small", "streaming": True, "tokenizer": "bytes",
                         "val_fraction": VAL_FRACTION, **fields})


def train_docs() -> list[int]:
    """The documented rule: every k-th document of the head held out (k = round(1 / data.val_fraction))."""
    return [i for i in range(N_DOCS) if i % round(1 / VAL_FRACTION)]


def read_part(cfg: DataConfig, rank: int, world: int) -> tuple[list[int], bytes]:
    """The documents (by their marker) rank `rank` of `world` reads in its first pass over its part, and its ids."""
    data = prepare(cfg)
    sampler = WindowSampler(data.train, 16, 3, seed=0, rank=rank, world_size=world, vocab_size=256)
    rows, after = [], 0
    while after < 3:  # the batch that starts the second pass holds the end of the first; then a few more
        x, _ = sampler.next_batch()
        rows.append(bytes(x.flatten().tolist()))
        after += sampler.epoch > 0
    text = b"".join(rows)
    seen = [int(m) for m in re.findall(rb"<doc (\d+)>", text)]
    first = seen[1:].index(seen[0]) + 1  # where the second pass starts
    return seen[:first], text


def test_two_ranks_read_disjoint_parts_that_cover_the_train_documents(repo):
    one, ids = read_part(config(repo), 0, 1)
    assert one == train_docs()
    assert ids.startswith(b"".join(doc(i).encode() for i in one))  # bytes: the documents' text, in order
    for world in (2, 3):  # 2 divides the 4 files (whole files per rank); 3 does not (every 3rd document)
        parts = [read_part(config(repo), rank, world)[0] for rank in range(world)]
        assert all(len(set(p)) == len(p) for p in parts)
        assert sorted(i for p in parts for i in p) == train_docs(), world  # disjoint, and all of them
        assert all(p == sorted(p) for p in parts)  # each in stream order


def test_validation_is_the_held_out_head_on_every_rank(repo):
    data = prepare(config(repo))
    held = [i for i in range(N_DOCS) if i % 10 == 0]
    assert bytes(data.val.tolist()) == b"".join(doc(i).encode() for i in held)
    assert data.corpus_info["val_documents"] == len(held) and data.corpus_info["kind"] == "stream"
    assert len(prepare(config(repo, val_fraction=0)).val) == 0
    with pytest.raises(DataError, match="is a stream"):
        len(data.train)


def checkpointed(state: dict) -> dict:
    """Through torch.save and a weights-only load, as a checkpoint holds it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("world", [1, 2])
def test_a_sampler_resumed_mid_stream_draws_the_batches_of_an_uninterrupted_one(repo, tmp_path, monkeypatch, world):
    """With a BPE and its eos, documents read 3 at a time and a second pass over the part: every cut point."""
    monkeypatch.setattr(streaming, "DOC_BATCH", 3)
    tok = train_bpe([doc(i) for i in range(N_DOCS)], 300, tmp_path / "bpe.json")
    cfg = config(repo, tokenizer=str(tmp_path / "bpe.json"))
    rank = world - 1
    BATCHES = 100  # noqa: N806

    def sampler():
        return WindowSampler(prepare(cfg).train, 8, 4, seed=0, rank=rank, world_size=world, vocab_size=300)

    straight = sampler()
    want = [straight.next_batch() for _ in range(BATCHES)]
    assert straight.epoch >= 1
    assert all(int(x.max()) < tok.vocab_size for x, _ in want) and any((x == tok.eos_id).any() for x, _ in want)
    for cut in (0, 1, 5, 17, 33, BATCHES - 5):
        first = sampler()
        for _ in range(cut):
            first.next_batch()
        resumed = sampler()
        resumed.load_state_dict(checkpointed(first.state_dict()))
        for k in range(cut, BATCHES):
            x, y = resumed.next_batch()
            assert torch.equal(x, want[k][0]) and torch.equal(y, want[k][1]), (cut, k)
        assert resumed.step == BATCHES


def test_a_position_saved_by_other_ranks_is_refused(repo):
    sampler = WindowSampler(prepare(config(repo)).train, 8, 2, seed=0, vocab_size=256)
    state = sampler.state_dict()
    with pytest.raises(DataError, match="saved by 2 process"):
        sampler.load_state_dict({**state, "ranks": state["ranks"] * 2})
    with pytest.raises(DataError, match="holds no stream position"):  # a WindowSampler's
        sampler.load_state_dict({"generator": state["generator"], "step": 3})
    with pytest.raises(DataError, match="does not fit this stream"):
        sampler.load_state_dict({**state, "ranks": [{"epoch": 0, "used": 0, "state": {"examples_iterable": 7}}]})


# ---- training ------------------------------------------------------------------------------------------

def losses(run_dir: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if "loss" in r and "event" not in r]


class Killed(Exception):
    pass


@pytest.mark.slow
def test_training_streams_and_resumes_bit_exact(repo, trainer_for, monkeypatch):
    monkeypatch.setattr(streaming, "DOC_BATCH", 4)
    extra = (f"data.source=hf:{repo}", "data.hf_config=small", "data.streaming=true", "data.tokenizer=bytes",
             f"data.val_fraction={VAL_FRACTION}", "run.ckpt_every=5", "run.steps=12", "run.seq_len=32")
    straight = trainer_for(*extra, name="straight")
    assert isinstance(straight.sampler, streaming.StreamSampler)
    straight.run()

    def kill(trainer, step):
        if step == 8:
            raise Killed

    killed = trainer_for(*extra, name="killed", callbacks=[kill])
    with pytest.raises(Killed):
        killed.run()
    assert main(["train", f"resume={killed.run_dir}", "run.progress=false"]) == 0
    assert losses(killed.run_dir) == losses(straight.run_dir)  # bit for bit
    assert len(losses(straight.run_dir)) == 12
    run = json.loads((straight.run_dir / "run.json").read_text())
    assert run["data"]["kind"] == "stream" and run["data"]["val_documents"] == N_DOCS // 10


@pytest.mark.slow
@pytest.mark.distributed
def test_two_gloo_ranks_stream_their_parts_and_resume_bit_exact(repo, tmp_path, torchrun):
    runs = tmp_path / "runs"
    common = [f"data.source=hf:{repo}", "data.hf_config=small", "data.streaming=true", "data.tokenizer=bytes",
              f"data.cache_dir={tmp_path / 'cache'}", f"run.out_dir={runs}", "run.steps=8", "run.ckpt_every=4",
              "run.eval_every=0", "run.seq_len=32", "run.batch_size=2",
              "run.curves=false"]
    torchrun("keel.cli", "train", "--preset", "tiny", *common, "run.name=ranks", timeout=300)
    two = losses(runs / "ranks")
    assert len(two) == 8
    part = shutil.copytree(runs / "ranks", runs / "part")
    shutil.rmtree(part / "checkpoints" / "step_00000008")
    torchrun("keel.cli", "train", f"resume={part}", timeout=300)
    assert losses(part) == two  # every rank back at its own position: bit for bit


# ---- bad input -----------------------------------------------------------------------------------------

def one_line(capsys, needle: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("keel: error: ") and needle in err[0], err
    return err[0]


def train(tmp_path: Path, *overrides: str) -> int:
    return main(["train", "--preset", "tiny", f"data.cache_dir={tmp_path / 'cache'}", f"run.out_dir={tmp_path / 'r'}",
                 "run.progress=false", "data.streaming=true", *overrides])


@pytest.mark.parametrize("overrides,needle", [
    (["data.hf_config=nope"], "data.hf_config: 'nope' is not a config (subset) of hf:"),
    ([], "has several configs (subsets); name one (configs: small, other)"),
    (["data.hf_config=small", "data.hf_split=test"], "data.hf_split: 'test' is not a split"),
    (["data.hf_config=small", "data.text_field=body"], "no column 'body' (data.text_field)"),
    (["data.hf_config=small", "data.tokenizer=bpe:300", "model.vocab_size=300"],
     "data.tokenizer: bpe:300 trains a BPE"),
])
def test_bad_stream_settings_are_one_line_exit_2(repo, tmp_path, capsys, overrides, needle):
    assert train(tmp_path, f"data.source=hf:{repo}", *overrides) == 2
    one_line(capsys, needle)
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").rglob("*.pt"))


def test_streaming_a_text_file_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "corpus.txt").write_text("some text\n" * 100)
    assert train(tmp_path, f"data.source={tmp_path / 'corpus.txt'}") == 2
    one_line(capsys, "is a text file")
    assert (tmp_path / "corpus.txt").read_text() == "some text\n" * 100


def test_a_local_jsonl_streams(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": doc(i)}) + "\n" for i in range(N_DOCS)))
    data = prepare(DataConfig(source=str(path), streaming=True, val_fraction=VAL_FRACTION))
    x, y = WindowSampler(data.train, 16, 2, seed=0, vocab_size=256).next_batch()
    assert bytes(x[0].tolist()) == (doc(1) + doc(2)).encode()[:16]
    assert torch.equal(x[:, 1:], y[:, :-1]) and int(y[0, -1]) == x[1, 0]


def test_offline_a_hub_name_is_one_line_at_once(tmp_path, monkeypatch, capsys):
    import datasets

    def no(*args, **kwargs):
        raise AssertionError("load_dataset was called")

    monkeypatch.setattr(datasets, "load_dataset", no)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.time()
    assert train(tmp_path, "data.source=hf:HuggingFaceFW/fineweb-edu", "data.hf_config=sample-10BT") == 2
    one_line(capsys, "HF_HUB_OFFLINE is set")
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ENDPOINT", "HTTPS_PROXY", "https_proxy", "ALL_PROXY",
                 "all_proxy"):
        monkeypatch.delenv(name, raising=False)

    def unreachable(request, timeout=None):
        assert request.full_url == "https://huggingface.co" and timeout == streaming.HUB_TIMEOUT_S
        raise urllib.error.URLError(socket.gaierror(-2, "Name or service not known"))

    monkeypatch.setattr(urllib.request, "urlopen", unreachable)
    assert train(tmp_path, "data.source=hf:HuggingFaceFW/fineweb-edu") == 2
    one_line(capsys, "cannot be reached (https://huggingface.co: [Errno -2] Name or service not known)")
    assert time.time() - start < 30  # no retries (datasets' own take ~25 s each)


@pytest.mark.parametrize("proxy,asked", [({"ALL_PROXY": "http://127.0.0.1:9"}, False),
                                         ({"https_proxy": "socks5://127.0.0.1:9"}, False),
                                         ({"HTTPS_PROXY": "http://127.0.0.1:9"}, True)])
def test_the_hub_is_asked_only_through_a_proxy_urllib_can_take(proxy, asked, monkeypatch):
    """urllib takes neither ALL_PROXY nor SOCKS, which huggingface_hub's requests take: behind those the stream is
    not refused on urllib's word; behind an HTTP(S) proxy urllib goes through it."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    for name, value in proxy.items():
        monkeypatch.setenv(name, value)
    tried = []

    def refused(request, timeout=None):
        tried.append(request.full_url)
        raise urllib.error.URLError(ConnectionRefusedError(111, "Connection refused"))

    monkeypatch.setattr(urllib.request, "urlopen", refused)
    if asked:
        with pytest.raises(DataError, match="cannot be reached"):
            streaming.check_hub("HuggingFaceFW/fineweb-edu")
    else:
        streaming.check_hub("HuggingFaceFW/fineweb-edu")
    assert bool(tried) == asked


def test_a_missing_local_path_is_not_looked_up_on_the_hub(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(streaming, "check_hub", lambda name: pytest.fail("the hub was tried"))
    assert train(tmp_path, f"data.source=hf:{tmp_path / 'nothing'}") == 2
    one_line(capsys, "no such directory")


@pytest.mark.slow  # over a second in tests/durations.json
def test_a_saved_dataset_streams_its_rows_in_order(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": [doc(i) for i in range(N_DOCS)]}).save_to_disk(tmp_path / "saved")
    cfg = DataConfig(source=f"hf:{tmp_path / 'saved'}", streaming=True, val_fraction=VAL_FRACTION)
    assert read_part(cfg, 0, 1)[0] == train_docs()
    parts = [read_part(cfg, r, 2)[0] for r in range(2)]
    assert sorted(parts[0] + parts[1]) == train_docs() and not set(parts[0]) & set(parts[1])
    assert np.array_equal(prepare(cfg).val, np.frombuffer(b"".join(doc(i).encode() for i in range(0, N_DOCS, 10)),
                                                          dtype=np.uint8))
