"""The Hugging Face bridges: export -> transformers' own loader gives the project's logits, HF `generate()`
gives `keel generate`'s tokens, the export loads without keel (remote code), tokenizers keep their ids,
a Llama imports with equal logits, and bad input is one clear line."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from keel.cli import main
from keel.data.tokenizer import ByteTokenizer, train_bpe
from keel.generate import generate

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from keel.hf import register  # noqa: E402
from keel.hf.export import export_run  # noqa: E402

register()  # KeelConfig / KeelForCausalLM with the Auto classes, so exports load without remote code

TEXT = "def parse(line):\n    return [int(x) for x in line.split()]  # héllo wörld ✓ 日本\n"


@pytest.mark.parametrize("scheme,options", [("keel", {}), ("keel", {"alpha": 3.5, "first_layer": "none"}),
                                            ("pre_ln", {"tie_embeddings": True}), ("hybrid_norm", {})])
def test_export_loads_with_transformers_and_gives_the_same_logits(tmp_path, scheme, options, make_run):
    model = make_run(tmp_path / "run", scheme, **options)
    out = export_run(tmp_path / "run", tmp_path / "hf")
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md", "modeling_keel.py"} <= {
        p.name for p in out.iterdir()}
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "KeelForCausalLM"
    idx = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, _ = model(idx)
        got = hf(idx).logits
    assert expected.abs().max() > 1
    print(f"{scheme} {options}: max |logit diff| = {(got - expected).abs().max().item():.3g}")
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    if options.get("tie_embeddings"):
        assert hf.model.lm_head.weight.data_ptr() == hf.model.embed.weight.data_ptr()


def test_hf_generate_equals_keel_generate(tmp_path, capsys, make_run):
    model = make_run(tmp_path / "run")
    out = export_run(tmp_path / "run", tmp_path / "hf")
    hf, tok = AutoModelForCausalLM.from_pretrained(out).eval(), AutoTokenizer.from_pretrained(out)
    lengths = []
    hf.model.register_forward_pre_hook(lambda module, args, kwargs: lengths.append(args[0].shape[1]),
                                       with_kwargs=True)
    prompt = tok("def ", return_tensors="pt").input_ids
    ours = generate(model, torch.tensor([list(b"def ")]), 25, temperature=0)
    theirs = hf.generate(prompt, max_new_tokens=25, do_sample=False)
    assert torch.equal(theirs, ours)
    assert lengths[0] == 4 and set(lengths[1:]) == {1}  # transformers fed one token per step: the cache works
    assert main(["generate", str(tmp_path / "run"), "--prompt", "def ", "--temperature", "0",
                 "--max-new-tokens", "25"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == ByteTokenizer().decode(theirs[0].tolist())


def test_exported_tokenizers_keep_keel_ids(tmp_path, make_run):
    make_run(tmp_path / "bytes")
    tok = AutoTokenizer.from_pretrained(export_run(tmp_path / "bytes", tmp_path / "bytes-hf"))
    every_byte = bytes(range(256)).decode("latin-1")  # 256 chars, multi-byte in UTF-8 from 128 up
    for text in (TEXT, every_byte, "Āā"):  # "Ā" is what ByteLevel shows byte 0 as: it must stay 2 bytes
        assert tok(text).input_ids == ByteTokenizer().encode(text)
        assert tok.decode(tok(text).input_ids) == text

    bpe = train_bpe([TEXT * 20, "for x in range(10):\n    print(x)\n" * 20], 300, tmp_path / "bpe.json")
    make_run(tmp_path / "bpe", tokenizer=bpe)
    tok = AutoTokenizer.from_pretrained(export_run(tmp_path / "bpe", tmp_path / "bpe-hf"))
    assert tok(TEXT).input_ids == bpe.encode(TEXT) and len(bpe.encode(TEXT)) < len(TEXT.encode())
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == bpe.eos_id


def test_model_card_states_scheme_depth_alpha_and_data(tmp_path, make_run):
    make_run(tmp_path / "run", "keel", alpha="L")
    card = (export_run(tmp_path / "run", tmp_path / "hf") / "README.md").read_text()
    assert "`keel`" in card and "3 blocks = 6 sub-layers" in card
    assert "6 (sub-layers 2..5)" in card and "1 (sub-layers 0..1)" in card  # first_layer v2: alpha 1 below
    assert "training data | `stdlib`" in card and "`step_00000007` (step 7)" in card


@pytest.mark.slow
def test_registration_with_the_auto_classes_is_explicit():
    """`import keel` and `import transformers` leave the Auto classes alone; `keel.hf.register()` adds
    KeelConfig and KeelForCausalLM, and a second call changes nothing."""
    script = """
import keel, keel.hf
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
assert "keel" not in CONFIG_MAPPING, "registered without being asked"
keel.hf.register()
keel.hf.register()
from keel.hf.configuration_keel import KeelConfig
from keel.hf.modeling_keel import KeelForCausalLM
assert CONFIG_MAPPING["keel"] is KeelConfig
assert type(AutoModelForCausalLM.from_config(KeelConfig(n_blocks=1, d_model=16, n_heads=2))) is KeelForCausalLM
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.slow
def test_export_loads_with_remote_code_where_keel_is_not_installed(tmp_path, make_run):
    model = make_run(tmp_path / "run")
    export_run(tmp_path / "run", tmp_path / "hf")
    alone = shutil.copytree(tmp_path / "hf", tmp_path / "elsewhere" / "model")
    idx = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(idx)[0][0, -1].tolist()
    script = f"""
import importlib.util, json, torch
assert importlib.util.find_spec("keel") is None, "keel is importable"
from transformers import AutoModelForCausalLM
hf = AutoModelForCausalLM.from_pretrained({str(alone)!r}, trust_remote_code=True).eval()
with torch.no_grad():
    print(json.dumps([type(hf).__module__, hf(torch.tensor([{idx[0].tolist()}])).logits[0, -1].tolist()]))
"""
    # -S: no site-packages .pth files, so not the editable install of keel; the packages come via PYTHONPATH
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    run = subprocess.run([sys.executable, "-S", "-c", script], cwd=tmp_path / "elsewhere", env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    module, logits = json.loads(run.stdout.strip().splitlines()[-1])
    assert module.startswith("transformers_modules.")
    assert logits == expected


def tiny_llama(hf_dir: Path, tied: bool = False):
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(5) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    hf.save_pretrained(hf_dir)
    return hf


@pytest.mark.parametrize("tied", [False, True])
def test_import_llama_round_trip(tmp_path, capsys, tied, make_run):
    hf = tiny_llama(tmp_path / "llama", tied)
    bpe = train_bpe([TEXT * 20], 300, tmp_path / "llama" / "tokenizer.json")
    (tmp_path / "corpus.txt").write_text(TEXT * 200)
    assert main(["import-hf", str(tmp_path / "llama"), str(tmp_path / "run"), "--data",
                 str(tmp_path / "corpus.txt")]) == 0
    from keel.runs.run_dir import load_model as load_run

    config, model, tokenizer, _ = load_run(tmp_path / "run")
    assert (config.model.scheme, config.model.n_blocks, config.model.tie_embeddings) == ("pre_ln", 2, tied)
    assert tokenizer.encode(TEXT) == bpe.encode(TEXT)
    idx = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = hf(idx).logits, model.eval()(idx)[0]
    print(f"import-hf (tied={tied}): max |logit diff| = {(got - expected).abs().max().item():.3g}")
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)

    capsys.readouterr()
    assert main(["generate", str(tmp_path / "run"), "--prompt", "def ", "--temperature", "0",
                 "--max-new-tokens", "10", "--raw"]) == 0  # --raw: the text as decoded, control bytes too
    ids = hf.generate(torch.tensor([bpe.encode("def ")]), max_new_tokens=10, do_sample=False)[0].tolist()
    assert capsys.readouterr().out.rstrip("\n") == bpe.decode(ids)
    assert main(["eval", str(tmp_path / "run"), "--batches", "1", "--device", "cpu"]) == 0


def _mismatched_run(tmp_path, make_run=None):
    make_run(tmp_path / "run")
    (tmp_path / "run" / "config.yaml").write_text(
        (tmp_path / "run" / "config.yaml").read_text().replace("d_model: 32", "d_model: 64"))


def _non_llama(tmp_path, make_run=None):
    tiny_llama(tmp_path / "llama")
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    (tmp_path / "llama" / "config.json").write_text(json.dumps(config | {"model_type": "gpt2"}))


def _llama_with_wrong_shapes(tmp_path, make_run=None):
    tiny_llama(tmp_path / "llama")
    train_bpe([TEXT * 20], 300, tmp_path / "llama" / "tokenizer.json")
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    (tmp_path / "llama" / "config.json").write_text(json.dumps(config | {"intermediate_size": 64}))


@pytest.mark.parametrize("setup,command,needle", [
    (lambda tmp, mk: (tmp / "nothing").mkdir(), ["export-hf", "{tmp}/nothing", "{tmp}/out"], "no config.yaml"),
    (lambda tmp, mk: (mk(tmp / "run"), shutil.rmtree(tmp / "run" / "tokenizer")),
     ["export-hf", "{tmp}/run", "{tmp}/out"], "tokenizer"),
    (_mismatched_run, ["export-hf", "{tmp}/run", "{tmp}/out"], "checkpoints/step_00000007: "),
    (lambda tmp, mk: (tmp / "nothing").mkdir(), ["lm-eval", "{tmp}/nothing", "--tasks", "x"], "nothing: neither"),
    (lambda tmp, mk: tiny_llama(tmp / "llama"), ["import-hf", "{tmp}/llama", "{tmp}/run"],
     "tokenizer.json: not found"),
    (_non_llama, ["import-hf", "{tmp}/llama", "{tmp}/run"], "config.json: model_type 'gpt2'"),
    (_llama_with_wrong_shapes, ["import-hf", "{tmp}/llama", "{tmp}/run"], "model.safetensors: does not match"),
    (lambda tmp, mk: (tmp / "x").mkdir(), ["import-hf", "{tmp}/x", "{tmp}/run"], "x/config.json: not found"),
])
def test_bad_input_is_one_clear_line_naming_the_file(tmp_path, capsys, setup, command, needle,
                                                    make_run):
    setup(tmp_path, make_run)
    capsys.readouterr()
    assert main([c.format(tmp=tmp_path) for c in command]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("keel: error: ") and needle in err[0], err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_export_refuses_a_non_empty_output_directory(tmp_path, capsys, make_run):
    make_run(tmp_path / "run")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert main(["export-hf", str(tmp_path / "run"), str(tmp_path / "out")]) == 2
    assert "out: already exists" in capsys.readouterr().err
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
