"""Data throughput on CPU: `keel data prepare`'s tokenising with 1 and 2 workers on a local corpus of >= 100 MB, and
the loaders' tokens a second against what a training step needs at the default job (cpu-demo) and at paper-512's
shape on the performance model's PREDICTED H100 step time.

    python benchmarks/data/throughput.py [--work /tmp/keel-data-bench] [--mb 100] [--out results.json]

The corpus (JSONL documents of about 4,000 characters cut from Python's standard library, cycled until --mb MiB of
text) and the shards are written under --work, never into the repository. A step's need is its tokens over its
PREDICTED time, read from `keel train --preset P --dry-run`; the loaders are timed drawing that step's
micro-batches (batch_size x seq_len, grad_accum of them a step) from the shards just written (in the page cache).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from keel.data import DataConfig, WindowSampler, prepare
from keel.data.shard_writer import prepare_shards
from keel.data.tokenizer import train_bpe

DOC_CHARS = 4000
BPE_VOCAB, BPE_DOCS = 32_000, 5_000  # paper-512's vocabulary; the BPE's sample in documents


def load() -> str:
    """The 1, 5 and 15-minute load averages: on a shared machine, what else was running."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def corpus(path: Path, mib: int) -> tuple[int, int]:
    """JSONL documents cut from the standard library's .py files, cycled (a copy number in each) to `mib` MiB of
    text; returns (documents, text bytes)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for f in sorted(root.rglob("*.py")):
        if "site-packages" in f.parts or "test" in f.parts:
            continue
        try:
            text = f.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        texts += [text[i:i + DOC_CHARS] for i in range(0, len(text), DOC_CHARS)]
    docs = size = copy = 0
    with open(path, "w") as out:
        while size < mib << 20:
            for text in texts:
                doc = f"# copy {copy}\n{text}"
                out.write(json.dumps({"text": doc}) + "\n")
                docs, size = docs + 1, size + len(doc.encode())
                if size >= mib << 20:
                    break
            copy += 1
    return docs, size


def timed_prepare(cfg: DataConfig, out: Path, workers: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    before, start = load(), time.perf_counter()
    done = prepare_shards(cfg, out, workers=workers, progress=False)
    seconds = time.perf_counter() - start
    tokens = sum(s["tokens"] for s in done["splits"].values())
    return {"workers": workers, "seconds": round(seconds, 1), "tokens": tokens,
            "tokens_per_s": round(tokens / seconds), "loadavg_before": before, "loadavg_after": load()}


def predicted_step(preset: str) -> dict:
    """Tokens a step and its PREDICTED H100 seconds, as `keel train --preset P --dry-run` prints them."""
    out = subprocess.run([sys.executable, "-m", "keel.cli", "train", "--preset", preset, "--dry-run"],
                         capture_output=True, text=True, check=True).stdout
    run = re.search(r"run: [\d,]+ steps x (\d+) x (\d+) sequences x (\d+) tokens", out)
    step = re.search(r"time on one H100 \(PREDICTED[^)]*\)[^:]*: .*?([\d.]+) s a step", out)
    batch, accum, seq = map(int, run.groups())
    return {"batch_size": batch, "grad_accum": accum, "seq_len": seq, "tokens_per_step": batch * accum * seq,
            "predicted_step_s": float(step[1])}


def timed_loader(train, shape: dict, seconds: float = 10.0) -> dict:
    """Micro-batches drawn for about `seconds`: tokens a second and the share of a PREDICTED step they take."""
    sampler = WindowSampler(train, shape["seq_len"], shape["batch_size"], seed=0, vocab_size=2**16)
    sampler.next_batch()  # the first maps and reads
    n, before, start = 0, load(), time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or n < 3:
        sampler.next_batch()
        n += 1
    rate = n * shape["batch_size"] * shape["seq_len"] / elapsed
    need = shape["tokens_per_step"] / shape["predicted_step_s"]
    return {**shape, "micro_batches": n, "tokens_per_s": round(rate), "need_tokens_per_s (PREDICTED)": round(need),
            "headroom": round(rate / need, 1), "loader_s_per_step": round(shape["tokens_per_step"] / rate, 3),
            "loadavg_before": before, "loadavg_after": load()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="/tmp/keel-data-bench")
    p.add_argument("--mb", type=int, default=100, help="MiB of text in the corpus")
    p.add_argument("--out", help="write the figures here as JSON")
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    results = {"cpus": os.cpu_count(), "loadavg_start": load()}
    path = work / "corpus.jsonl"
    docs, size = corpus(path, args.mb)
    results["corpus"] = {"documents": docs, "text_bytes": size, "file_bytes": path.stat().st_size}
    print(f"corpus: {docs:,} documents, {size / 2**20:.0f} MiB of text ({path})", flush=True)

    start = time.perf_counter()
    bpe = train_bpe((json.loads(line)["text"] for line, _ in zip(open(path), range(BPE_DOCS))), BPE_VOCAB,
                    work / "bpe.json")
    results["bpe_training"] = {"documents": BPE_DOCS, "vocab": bpe.vocab_size,
                               "seconds": round(time.perf_counter() - start, 1)}
    print(f"BPE {bpe.vocab_size:,} on {BPE_DOCS:,} documents: {results['bpe_training']['seconds']} s", flush=True)

    results["prepare"] = {}
    for name, tokenizer in (("bpe-32000", str(work / "bpe.json")), ("bytes", "bytes")):
        cfg = DataConfig(source=str(path), tokenizer=tokenizer, val_fraction=0.001)
        for workers in (1, 2):
            r = timed_prepare(cfg, work / f"shards-{name}-{workers}", workers)
            r["mb_per_s"] = round(size / 2**20 / r["seconds"], 2)
            results["prepare"][f"{name}, {workers} worker(s)"] = r
            print(f"prepare {name}, {workers} worker(s): {r['seconds']} s, {r['mb_per_s']} MiB/s of text, "
                  f"{r['tokens_per_s']:,} tokens/s (load {r['loadavg_before']} -> {r['loadavg_after']})", flush=True)

    results["loader"] = {}
    for preset, shards in (("cpu-demo", "shards-bytes-1"), ("paper-512", "shards-bpe-32000-1")):
        tokenizer = "bytes" if "bytes" in shards else str(work / "bpe.json")
        data = prepare(DataConfig(source=str(work / shards), tokenizer=tokenizer, cache_dir=str(work / "cache")))
        r = timed_loader(data.train, predicted_step(preset))
        results["loader"][preset] = r
        print(f"loader at {preset} ({r['batch_size']} x {r['seq_len']}, {r['grad_accum']} a step): "
              f"{r['tokens_per_s']:,} tokens/s; a step needs {r['need_tokens_per_s (PREDICTED)']:,} "
              f"(PREDICTED {r['predicted_step_s']} s on one H100): {r['headroom']}x, "
              f"{r['loader_s_per_step']} s of loading a step (load {r['loadavg_before']})", flush=True)

    cfg = DataConfig(source=str(path), tokenizer=str(work / "bpe.json"), streaming=True, val_fraction=0.001)
    data = prepare(cfg)
    r = timed_loader(data.train, predicted_step("paper-512"))
    results["stream_loader"] = {"paper-512": r}
    print(f"stream (data.streaming=true, this JSONL, the BPE) at paper-512: {r['tokens_per_s']:,} tokens/s; a step "
          f"needs {r['need_tokens_per_s (PREDICTED)']:,} (PREDICTED): {r['headroom']}x (load {r['loadavg_before']})",
          flush=True)
    results["loadavg_end"] = load()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
