"""How ``jobs/examples/tokenizer.json`` was made: a byte-level BPE of 4,096 ids trained with Hugging Face
``tokenizers`` on the license texts Debian ships (``/usr/share/common-licenses``, the regular files in
sorted name order, as ``jobs.data.datasets.load_licenses`` reads them), nothing downloaded.

    python jobs/examples/make_tokenizer.py jobs/examples/tokenizer.json            # vocabulary 4,096
    python jobs/examples/make_tokenizer.py /tmp/tiny.json --vocab-size 512        # what the tests train

Its one special token, ``<|endoftext|>`` (id 0), is the end-of-document token ``hpc data prepare`` appends
to every document. The tokenizer decodes back to the exact text (byte-level, no normalizer).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jobs.data.datasets import license_files

EOS = "<|endoftext|>"


def train_tokenizer(files: list[Path], vocab_size: int):  # -> tokenizers.Tokenizer
    """A byte-level BPE over ``files`` with ``EOS`` as its only special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(p) for p in files], trainer)
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the tokenizer.json to write")
    parser.add_argument("--vocab-size", type=int, default=4096, help="ids, special token included (default 4096)")
    args = parser.parse_args()
    train_tokenizer(license_files(), args.vocab_size).save(str(args.out), pretty=False)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
