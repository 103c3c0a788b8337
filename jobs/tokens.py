"""A tokenized data set as ``hpc data prepare`` writes it (``jobs/prepare.py``), and the data entry that reads it.

A prepared directory holds:

- ``tokens.bin``: every document's token ids followed by the tokenizer's EOS id, all documents
  concatenated; little-endian ``uint16`` when every id fits (a vocabulary of at most 65,536), else ``uint32``;
- ``offsets.bin``: little-endian ``int64``, documents + 1 entries: document i is
  ``tokens[offsets[i]:offsets[i + 1]]``, its EOS last;
- ``tokenizer.json``: the tokenizer it was made with;
- ``meta.json``: what the files hold (``format``, dtype, counts), the tokenizer (source, sha256, vocabulary
  size, EOS) and the source files (path, bytes, sha256, documents). It is written last and the directory
  is renamed into place whole, so a directory with ``meta.json`` is complete.

The entry ``jobs.tokens:tokens`` (``data.entry``, ``data.args.path``) memory-maps the tokens: training
windows of ``seq_len + 1`` tokens drawn anywhere in the training documents as a pure function of
(seed, step), held-out windows tiling a seeded set of whole documents, and the vocabulary checked
against the model's (``check_spec``, run by ``hpc run`` before any rank starts, and by the entry).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hpc.errors import ConfigError
from jobs.protocol import TOKENS_ENTRY, DataSplits

if TYPE_CHECKING:
    import torch

    from hpc.config import JobSpec

FORMAT = "hpc-tokens"
VERSION = 1
META, TOKENS, OFFSETS, TOKENIZER = "meta.json", "tokens.bin", "offsets.bin", "tokenizer.json"
OFFSET_DTYPE = "<i8"
GPT_ENTRY = "jobs.gpt:gpt"


def token_dtype(vocab_size: int) -> str:
    """The narrowest id type: ``uint16`` when every id is below 65,536, else ``uint32``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def read_meta(path: str | Path, key: str = "data.args.path") -> dict[str, Any]:
    """``meta.json`` of a prepared directory; one line naming ``key`` when it is not one."""
    directory = Path(path)
    meta_path = directory / META
    if not meta_path.is_file():
        what = "does not exist" if not directory.exists() else f"has no {META} (not made by hpc data prepare)"
        raise ConfigError(f"{key}={str(path)!r} {what}: prepare it with hpc data prepare --out {path} ...")
    try:
        meta = json.loads(meta_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{key}={str(path)!r}: {META} is not JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ConfigError(f"{key}={str(path)!r}: {META} is not {FORMAT} version {VERSION}")
    return meta


def check_vocab(meta: dict[str, Any], path: str | Path, vocab_size: int | None,
                where: str = "vocabulary") -> None:
    """Raise when the set's ids can reach past the model's vocabulary (``where`` says whose it is)."""
    ids = meta["tokenizer"]["vocab_size"]
    if vocab_size is not None and ids > vocab_size:
        fix = (f"model.entry = {GPT_ENTRY!r} with model.args.vocab_size = {ids} (jobs/examples/gpt_tokens.toml)"
               if "model.kind" in where else f"a model with a vocabulary of at least {ids:,}")
        raise ConfigError(f"data.args.path={str(path)!r} was tokenized with {ids:,} ids "
                          f"({meta['tokenizer']['source']}), more than the model's {where} of {vocab_size:,}: "
                          f"train {fix}")


def model_window(spec: JobSpec) -> tuple[int, int | None, str]:
    """The model's window length, its vocabulary as the spec says it (None when it does not) and whose it is."""
    model = spec.model
    if not model.entry:
        return model.seq_len, model.vocab_size, f"vocabulary (model.kind={model.kind!r} reads bytes)"
    vocab = model.args.get("vocab_size")
    seq_len = int(model.args.get("seq_len", model.seq_len))
    return seq_len, None if vocab is None else int(vocab), "vocabulary (model.args.vocab_size)"


def built_vocab(spec: JobSpec) -> int | None:
    """The input embedding's rows of the model built on the meta device (no memory), for a spec whose
    ``[model.args]`` do not say (a transformers model from ``pretrained``'s config)."""
    import torch

    from jobs.protocol import build_model

    with torch.device("meta"):
        model = build_model(spec)
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else next(
        (module for module in model.modules() if isinstance(module, torch.nn.Embedding)), None)
    return getattr(embedding, "num_embeddings", None)


def entry_args(spec: JobSpec) -> dict[str, Any]:
    """``tokens``'s keyword arguments for ``spec``: the model's ``seq_len`` and ``vocab_size``, then ``data.args``."""
    if "vocab_size" in spec.data.args:
        raise ConfigError("data.args.vocab_size: the token set is checked against the model's own vocabulary "
                          "(model.args.vocab_size); leave it out")
    seq_len, vocab, _ = model_window(spec)
    return {"seq_len": seq_len, **dict(spec.data.args), "vocab_size": vocab}


def check_spec(spec: JobSpec) -> None:
    """Before any rank starts: a token set's directory is complete and its ids fit the model's vocabulary."""
    if spec.data.entry != TOKENS_ENTRY:
        return
    path = spec.data.args.get("path")
    if not isinstance(path, str):
        raise ConfigError(f"data.entry={TOKENS_ENTRY!r} needs data.args.path = the directory hpc data prepare wrote")
    meta = read_meta(path)
    entry_args(spec)  # refuses data.args.vocab_size
    _, vocab, where = model_window(spec)
    if vocab is None:
        vocab, where = built_vocab(spec), "input embedding"
    check_vocab(meta, path, vocab, where)


class TokenSet:
    """A prepared directory, memory-mapped: ``tokens`` and ``offsets`` as read-only numpy arrays."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.meta = read_meta(path)
        directory, counts = self.path, self.meta
        self.tokens = _map(directory / TOKENS, np.dtype(counts["tokens"]["dtype"]).newbyteorder("<"),
                           counts["tokens"]["count"], path)
        self.offsets = _map(directory / OFFSETS, np.dtype(OFFSET_DTYPE), counts["documents"] + 1, path)

    @property
    def documents(self) -> int:
        return len(self.offsets) - 1

    def document(self, index: int) -> np.ndarray:
        """Document ``index``'s ids, its EOS last."""
        return self.tokens[self.offsets[index]: self.offsets[index + 1]]


def _map(file: Path, dtype: np.dtype, count: int, path: str | Path) -> np.ndarray:
    size = file.stat().st_size if file.is_file() else -1
    if size != count * dtype.itemsize:
        raise ConfigError(f"data.args.path={str(path)!r}: {file.name} holds {size} bytes, {META} says "
                          f"{count} x {dtype.itemsize}")
    if count == 0:
        return np.zeros(0, dtype)
    return np.memmap(file, dtype=dtype, mode="r", shape=(count,))


def held_out_documents(documents: int, fraction: float, seed: int) -> np.ndarray:
    """A boolean mask of the held-out documents: ``round(fraction * documents)`` of them (at least one when
    ``fraction`` > 0, never all), drawn by ``seed`` alone so every job seed evaluates on the same ones."""
    if not 0 <= fraction < 1:
        raise ConfigError(f"data.args.held_out={fraction} must be in [0, 1)")
    mask = np.zeros(documents, dtype=bool)
    count = min(max(round(fraction * documents), 1 if fraction else 0), documents - 1)
    if count > 0:
        mask[np.random.default_rng([seed, documents]).choice(documents, count, replace=False)] = True
    return mask


def runs(offsets: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first token, length) of each run of consecutive documents ``keep`` selects."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], keep.astype(np.int8), [0]))))
    first_doc, end_doc = edges[0::2], edges[1::2]
    starts = np.asarray(offsets[first_doc], dtype=np.int64)
    return starts, np.asarray(offsets[end_doc], dtype=np.int64) - starts


class TokenWindows:
    """Map-style windows over runs of a token file joined end to end: item i is (inputs, next tokens),
    ``seq_len`` each, starting ``i * stride`` tokens into the joined runs."""

    masks_targets = False  # every next token counts: no -100 marks, so no count of counted targets to agree on

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray, seq_len: int,
                 stride: int = 1) -> None:
        self.tokens, self.starts, self.seq_len, self.stride = tokens, starts, seq_len, stride
        self.joined = np.concatenate(([0], np.cumsum(lengths)))  # run k starts at joined[k] of the joined text
        self.size = int(self.joined[-1])
        if self.size <= seq_len:
            raise ConfigError(f"model.seq_len={seq_len} needs windows of {seq_len + 1} tokens, but the set has "
                              f"{self.size:,} here")

    def __len__(self) -> int:
        return (self.size - self.seq_len - 1) // self.stride + 1

    def file_positions(self, positions: np.ndarray) -> np.ndarray:
        """``[len(positions), seq_len + 1]``: where in the token file each window's tokens are."""
        joined = np.asarray(positions, dtype=np.int64)[:, None] + np.arange(self.seq_len + 1)
        run = np.searchsorted(self.joined, joined, side="right") - 1
        return self.starts[run] + joined - self.joined[run]

    def windows(self, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets of the windows starting at ``positions`` of the joined runs."""
        import torch

        ids = torch.from_numpy(self.tokens[self.file_positions(positions)].astype(np.int64))
        return ids[:, :-1], ids[:, 1:]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        inputs, targets = self.windows(np.array([index * self.stride]))
        return inputs[0], targets[0]

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        inputs, targets = self.windows(np.asarray(indices, dtype=np.int64) * self.stride)
        return list(zip(inputs, targets, strict=True))

    def batch_indices(self, step: int, batch_size: int, seed: int) -> np.ndarray:
        """Windows drawn anywhere in the joined runs, with replacement: ``window_starts`` (pure in seed, step)."""
        from jobs.datasets import window_starts

        return window_starts(self.size, batch_size, self.seq_len, seed, step) // self.stride


def tokens(path: str, seq_len: int, vocab_size: int | None = None, held_out: float = 0.01,
           split_seed: int = 0) -> DataSplits:
    """The ``jobs.tokens:tokens`` entry: training windows drawn from the documents not held out, held-out
    windows tiling the ``held_out`` fraction of whole documents (``held_out = 0``: none). ``seq_len`` and
    ``vocab_size`` default to the model's (``entry_args``)."""
    data = TokenSet(path)
    check_vocab(data.meta, path, vocab_size)
    mask = held_out_documents(data.documents, held_out, split_seed)
    train = TokenWindows(data.tokens, *runs(data.offsets, ~mask), seq_len)
    if not mask.any():
        return DataSplits(train)
    held = runs(data.offsets, mask)
    if held[1].sum() <= seq_len:
        raise ConfigError(f"data.args.held_out={held_out}: the {int(mask.sum()):,} held-out documents of "
                          f"{path!r} hold {int(held[1].sum()):,} tokens, fewer than a window of {seq_len + 1}: "
                          "raise it, or 0 for no held-out set")
    return DataSplits(train, TokenWindows(data.tokens, *held, seq_len, stride=seq_len))
