"""keel.evals: task names, probe items from the validation split only, and scores that mean something: a trained
tiny model above chance, an untrained one at chance, an lm_eval task equal to `keel lm-eval` on the same weights."""

import json
import math
import random

import numpy as np
import pytest
import torch

from keel import evals
from keel.data import DataConfig, build_corpus, prepare
from keel.data.corpus import Corpus
from keel.data.tokenizer import ByteTokenizer
from keel.errors import ConfigError
from keel.evals.probes import doc_sha
from keel.model import ModelConfig, TransformerLM
from mc_task import write_local_task

VERBS = ["get", "set", "make", "read", "load", "save", "find", "drop"]
NOUNS = ["item", "node", "path", "user", "file", "page", "list", "word", "line", "name"]


def source(rng: random.Random) -> str:
    """A small Python file of a fixed shape (brackets, quotes, nesting to 12 spaces, names used again within a
    few lines), its names drawn from `rng`."""
    out = []
    for _ in range(8):
        name, arg = f"{rng.choice(VERBS)}_{rng.choice(NOUNS)}", rng.choice(NOUNS)
        out += [f"def {name}({arg}, size=[{rng.randint(1, 9)}, {rng.randint(1, 9)}]):",
                f"    table = {{'{arg}': ({arg}, size)}}",
                f"    for part in {arg}:",
                "        if part:",
                f"            table[part] = {name}(part)",
                "    return table",
                "",
                f"{name.upper()} = {name}(\"{rng.choice(NOUNS)}\")",
                ""]
    return "\n".join(out)


def write_corpus(root, n_files: int = 60, seed: int = 0):
    """A directory of `n_files` generated files; a quarter of them (by the hash of their path) are validation."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        (root / f"module_{i:02d}.py").write_text(source(rng))
    return root


@pytest.fixture
def data(tmp_path) -> DataConfig:
    return DataConfig(source=str(write_corpus(tmp_path / "corpus")), val_fraction=0.25,
                      cache_dir=str(tmp_path / "cache"))


def tiny(seed: int = 0, dropout: float = 0.0) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(ModelConfig(vocab_size=256, d_model=64, n_blocks=2, n_heads=4, max_seq_len=128,
                                     dropout=dropout))


# ---- names -----------------------------------------------------------------------------------------

def test_resolve_names_probes_with_their_chance_and_refuses_a_bad_name_in_one_line():
    tasks = evals.resolve(["brackets", "indent", "identifiers", "next_line"])
    assert [t.name for t in tasks] == ["brackets", "indent", "identifiers", "next_line"]
    assert all(t.chance == 0.25 for t in tasks)
    with pytest.raises(ConfigError) as err:
        evals.resolve(["brackets", "bracket"])
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("run.eval_tasks: unknown task 'bracket' (did you mean 'brackets'?)")
    assert all(name in message for name in evals.PROBES) and "lm_eval:<task>" in message
    with pytest.raises(ConfigError, match=r"^train\.tasks: .*no-such\.yaml.*cannot read"):
        evals.resolve(["lm_eval:no-such.yaml"], field="train.tasks")
    with pytest.raises(ConfigError, match="named twice"):
        evals.resolve(["indent", "indent"])


# ---- items -----------------------------------------------------------------------------------------

def test_probe_items_are_deterministic_versioned_and_cut_from_validation_files_only(data, tmp_path, monkeypatch):
    read = []
    documents = Corpus.documents
    monkeypatch.setattr(Corpus, "documents", lambda self, split: read.append(split) or documents(self, split))
    first = evals.prepare(evals.resolve(list(evals.PROBES)), data, ByteTokenizer())
    assert set(read) == {"val"}  # training text is never read
    again = DataConfig(**{**vars(data), "cache_dir": str(tmp_path / "other-cache")})
    assert evals.prepare(evals.resolve(list(evals.PROBES)), again, ByteTokenizer()) == first  # generated anew
    cached = sorted(p.name for p in (tmp_path / "cache" / "evals").rglob("*.jsonl"))
    assert cached == sorted(f"{name}-v1.jsonl" for name in evals.PROBES)

    monkeypatch.setattr(Corpus, "documents", documents)
    corpus = build_corpus(data)
    val = {doc_sha(t): t for t in corpus.documents("val")}
    train = {doc_sha(t) for t in corpus.documents("train")}
    assert 8 <= len(val) <= 25 and len(train) >= 35
    for name, items in first.items():
        assert len(items) >= 40, name
        counts = np.bincount([it["answer"] for it in items], minlength=4)
        assert counts.min() > 0, (name, counts)  # the answer's place is shuffled
        for it in items:
            assert it["version"] == evals.PROBES[name].version and it["task"] == name
            assert it["doc_sha"] in val and it["doc_sha"] not in train
            assert len(it["choices"]) == 4 == len(set(it["choices"]))
            text = val[it["doc_sha"]]
            true = it["choices"][it["answer"]]
            assert (it["context"] + true.rstrip("\n")) in text, (name, it)


def test_probes_balance_what_a_fixed_preference_could_exploit(data):
    """A scorer that always picks the shortest choice, or always the same character, is at chance exactly."""
    items = evals.prepare(evals.resolve(list(evals.PROBES)), data, ByteTokenizer())
    for name in ("indent", "next_line"):
        shortest = [min(range(4), key=lambda j: len(it["choices"][j])) == it["answer"] for it in items[name][:200]]
        assert np.mean(shortest) == pytest.approx(0.25, abs=0.02), name
    for closer in ")]}":
        picks = [it["choices"][it["answer"]] == closer for it in items["brackets"][:200]]
        assert np.mean(picks) == pytest.approx(0.25, abs=0.02)
    assert all(len({len(c) for c in it["choices"]}) == 1 for it in items["identifiers"])


# ---- scoring ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("training", [True, False])
def test_scoring_leaves_mode_weights_and_random_generators_as_they_were(data, training):
    model = tiny(dropout=0.1).train(training)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(6)
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    scores = evals.score(model, evals.resolve(["brackets", "next_line"]), data, ByteTokenizer(), max_items=8,
                         device="cpu")
    assert model.training is training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), states[0]) and random.getstate() == states[1]
    assert np.array_equal(np.random.get_state()[1], states[2])
    assert set(scores) == {"brackets", "next_line"} and scores["brackets"]["n"] == 8
    # scoring is deterministic: dropout is off while scoring, whatever the mode
    again = evals.score(model, evals.resolve(["brackets", "next_line"]), data, ByteTokenizer(), max_items=8,
                        device="cpu")
    assert again == scores


def test_contexts_are_cut_from_the_left_to_the_models_length(data):
    """An item scored by a model of max_seq_len 128 equals the same item scored by hand on its last tokens."""
    model = tiny().eval()
    item = evals.prepare(evals.resolve(["next_line"]), data, ByteTokenizer())["next_line"][0]
    assert len(item["context"]) > 200
    got = evals.scorer.Scorer(model, ByteTokenizer(), "cpu").loglikelihoods(
        [(list(item["context"].encode()), list(c.encode())) for c in item["choices"]])
    for (ll, _), choice in zip(got, item["choices"]):
        ids = torch.tensor([list((item["context"] + choice).encode())[-129:]])
        with torch.no_grad():
            logp = model(ids[:, :-1])[0].log_softmax(-1)[0]
        n = len(choice.encode())
        expected = sum(logp[128 - n + i, ids[0, 129 - n + i]].item() for i in range(n))
        assert ll == pytest.approx(expected, abs=1e-4)


def train(model: TransformerLM, data: DataConfig, steps: int) -> TransformerLM:
    from keel.data import WindowSampler

    tokens = prepare(data).train
    sampler = WindowSampler(tokens, 128, 16, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        x, y = sampler.next_batch()
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"final training loss {loss.item():.3f}")
    return model


@pytest.mark.slow
def test_a_trained_tiny_model_beats_chance_and_an_untrained_one_does_not(data):
    """indent and next_line put a random-init model at chance exactly (it prefers short continuations, and the
    answer is each length rank equally often). brackets and identifiers are not a uniform guess for one random
    init on this small repetitive corpus: its preference follows the last few characters, which repeat here, so
    it is right or wrong on whole groups of items (seeds 0-4: brackets 0.08-0.45, mean 0.25; identifiers
    0.22-0.40, mean 0.33, a bag-of-context bias toward names present in the context); they are printed, not
    asserted, for the untrained model."""
    tasks = evals.resolve(list(evals.PROBES))
    untrained = evals.score(tiny(), tasks, data, ByteTokenizer(), max_items=200, device="cpu")
    # 60 steps put three probes far past the bar of chance + 6 sigma (0.43 at n=200): brackets 0.99, indent 1.0,
    # next_line 0.81, identifiers 0.51 (50 steps: 0.87, 1.0, 0.62, 0.44; 100 steps: 1.0, 1.0, 0.90, 0.45; 300
    # steps: 1.0, 1.0, 0.95, 0.69, at five times the training)
    trained = evals.score(train(tiny(), data, 60), tasks, data, ByteTokenizer(), max_items=200, device="cpu")
    for name in evals.PROBES:
        t = trained[name]
        print(f"{name:12s} n={t['n']:3d} chance {t['chance']:.2f}  untrained {untrained[name]['acc']:.3f}  "
              f"trained {t['acc']:.3f} (norm {t['acc_norm']:.3f})")
    for name, s in untrained.items():
        if name in ("brackets", "identifiers"):
            continue
        noise = math.sqrt(s["chance"] * (1 - s["chance"]) / s["n"])
        assert abs(s["acc"] - s["chance"]) < 4 * noise, (name, s)
    above = [name for name, s in trained.items()
             if s["acc"] > s["chance"] + 6 * math.sqrt(s["chance"] * (1 - s["chance"]) / s["n"])]
    assert len(above) >= 2, trained


# ---- lm-evaluation-harness -------------------------------------------------------------------------

@pytest.mark.slow
def test_an_lm_eval_task_on_the_model_object_equals_keel_lm_eval_on_the_saved_run(tmp_path, make_run, capsys):
    pytest.importorskip("lm_eval")
    pytest.importorskip("transformers")
    from keel.cli import main
    from keel.runs.run_dir import load_model

    yaml_path = write_local_task(tmp_path / "tasks")
    make_run(tmp_path / "run")
    _, model, _, _ = load_model(tmp_path / "run")
    model.train()
    [task] = evals.resolve([f"lm_eval:{yaml_path}"])
    ours = evals.score(model, [task], DataConfig(), ByteTokenizer(), device="cpu")[task.name]
    assert model.training

    assert main(["lm-eval", str(tmp_path / "run"), "--tasks", "keel_tiny_mc", "--include-path",
                 str(tmp_path / "tasks"), "--device", "cpu"]) == 0
    theirs = json.loads((tmp_path / "run" / "lm_eval-keel_tiny_mc.json").read_text())["results"]["keel_tiny_mc"]
    print(f"in memory {ours}; keel lm-eval acc {theirs['acc,none']}")
    assert ours["acc"] == pytest.approx(theirs["acc,none"], abs=1e-12)
    assert ours["metrics"]["acc_norm"] == pytest.approx(theirs["acc_norm,none"], abs=1e-12)
    assert ours["n"] == 8 and ours["chance"] == 0.25
