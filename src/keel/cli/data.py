"""`keel data prepare`: a corpus into token shards that `keel train data.source=DIR` reads (keel.data.shard_writer).
The corpus and tokenizer are named with the `data.*` fields `keel train` takes."""

from __future__ import annotations

from keel.cli import COMMANDS
from keel.cli.support import DefaultsShown, add_data_arguments, output_dir
from keel.config.reads import Reads

PREPARE = Reads("keel data prepare", ("data.source", "data.text_field", "data.hf_split", "data.hf_config",
                                      "data.tokenizer", "data.val_fraction"),
                why="it tokenises a corpus: data.* fields only", hints={"data.cache_dir": "the shards go to --out"},
                shorthand="data")


def cmd_prepare(args) -> int:
    from keel.config import TrainConfig, merge
    from keel.data.shard_writer import prepare_shards

    data = merge(TrainConfig(), args.config, args.overrides, PREPARE).data
    output_dir(args.out, "--out", make=False)  # a link, a file, a device, read-only: one line before any reading
    done = prepare_shards(data, args.out, args.workers, args.shard_tokens, args.bpe_sample)
    if done["up_to_date"]:
        print(f"{done['directory']}: up to date, nothing written")
    for split, s in done["splits"].items():
        print(f"{split}: {s['shards']} shard(s) ({s['new_shards']} new), {s['tokens']:,} tokens, "
              f"{s['documents']:,} documents")
    print(f"{done['dtype']}, tokenizer {done['tokenizer']} ({done['vocab_size']:,} tokens); train from them with: "
          f"keel train data.source={done['directory']} data.tokenizer={data.tokenizer}")
    return 0


def add_data_command(sub) -> None:
    from keel.data.shard_writer import DEFAULT_BPE_SAMPLE

    p = sub.add_parser("data", help=COMMANDS["data"])
    commands = p.add_subparsers(dest="data_command", required=True, metavar="prepare")
    q = commands.add_parser("prepare", formatter_class=DefaultsShown,
                            help="a corpus into token shards with a manifest, made by worker processes; run again "
                                 "to resume after a kill or to add new documents",
                            description="Tokenise data.source with data.tokenizer into fixed-size token shards and a "
                                        "manifest.json under --out. The same command again resumes a killed prepare, "
                                        "adds documents appended to the corpus as new shards, or changes nothing.")
    q.add_argument("--out", required=True, help="the shard directory (new, or one this command wrote)")
    q.add_argument("--workers", type=int, default=1, help="tokenising processes (the shards do not depend on it)")
    q.add_argument("--shard-tokens", type=int, default=None,
                   help="tokens per shard (default: 100,000,000, or the directory's own)")
    q.add_argument("--bpe-sample", type=int, default=DEFAULT_BPE_SAMPLE,
                   help="data.tokenizer=bpe[:N]: train documents the BPE is trained on, drawn with a fixed seed")
    add_data_arguments(q, "data.source=corpus.jsonl data.tokenizer=bpe:32000")
    q.set_defaults(func=cmd_prepare)

