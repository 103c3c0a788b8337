"""``hpc data prepare``: tokenize text, JSONL or Parquet files into a directory ``jobs.data.tokens:tokens`` trains on.

The work is ``jobs.data.prepare``; nothing heavy at module level (``hpc --help`` imports this).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

PREPARE_HELP = """\
Documents: plain text files (any suffix but .jsonl, .ndjson, .parquet) are cut at blank lines, one
paragraph one document; JSONL (.jsonl, .ndjson) is one document per line, its "text" field (--field);
Parquet (.parquet, needs pyarrow) one per row of the "text" column (--field). Each document is encoded
without special tokens, then the tokenizer's EOS appended.

OUT gets tokens.bin (uint16 ids when the vocabulary fits, else uint32), offsets.bin (int64, where each
document starts), tokenizer.json and meta.json (tokenizer, vocabulary size, dtype, counts, source files
and their sha256). It is written as OUT.tmp-PID-* and renamed when complete: a failed or interrupted run
leaves no OUT. Train on it with data.entry = "jobs.data.tokens:tokens" and data.args.path = OUT.

OUT must not exist. --force replaces only a token set a previous hpc data prepare wrote (a directory of
just meta.json, tokens.bin, offsets.bin and tokenizer.json); anything else there (a file, a link, a
directory holding anything more, or an input file) is refused, and nothing it did not write is deleted.
"""


def add_parser(commands: argparse._SubParsersAction) -> None:
    data = commands.add_parser("data", help="prepare a tokenized data set (hpc data prepare)")
    kinds = data.add_subparsers(dest="data_command", required=True, metavar="COMMAND")
    prepare = kinds.add_parser("prepare", help="tokenize text, JSONL or Parquet files into a token set",
                               description=PREPARE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    prepare.add_argument("files", nargs="+", metavar="FILE", help="input files, read in the order given")
    prepare.add_argument("--tokenizer", required=True,
                         help="a tokenizer.json (Hugging Face tokenizers), or a transformers tokenizer directory "
                              "holding one; read locally, nothing downloaded")
    prepare.add_argument("--out", required=True, help="the directory to write; it must not exist (see --force)")
    prepare.add_argument("--field", default="text", help="the JSONL field or Parquet column holding the text "
                                                         "(default %(default)s)")
    prepare.add_argument("--eos", help="the end-of-document token (default: eos_token of tokenizer_config.json "
                                       "beside the tokenizer, else a special token <|endoftext|>, </s>, ...)")
    prepare.add_argument("--force", action="store_true", help="replace OUT when it is a token set hpc data prepare "
                                                              "wrote (once the new one is complete); nothing else")
    prepare.set_defaults(handler=cmd_prepare)


def cmd_prepare(args: argparse.Namespace) -> int:
    from hpc.text import human_bytes
    from jobs.data.prepare import prepare

    start = time.perf_counter()
    # past a file size limit (ulimit -f) a write fails with EFBIG, reported as one line, instead of SIGXFSZ's core
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        meta = prepare(args.files, args.tokenizer, args.out, args.field, args.eos, args.force,
                       progress=sys.stderr.isatty())
    finally:
        signal.signal(signal.SIGXFSZ, previous)
    seconds = time.perf_counter() - start
    size = sum(source["bytes"] for source in meta["sources"])
    tokenizer = meta["tokenizer"]
    print(f"{args.out}: {meta['documents']:,} documents, {meta['tokens']['count']:,} tokens "
          f"({meta['tokens']['dtype']}, vocabulary {tokenizer['vocab_size']:,}, EOS {tokenizer['eos']} = "
          f"{tokenizer['eos_id']}) from {len(meta['sources'])} files, {human_bytes(size)} in {seconds:.1f} s "
          f"({human_bytes(size / max(seconds, 1e-9))}/s)")
    return 0
