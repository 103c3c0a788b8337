"""A tokenized data set as ``hpc data prepare`` writes it (``jobs/data/prepare.py``), and the data entry that reads it.

A prepared directory holds:

- ``tokens.bin``: every document's token ids followed by the tokenizer's EOS id, all documents
  concatenated; little-endian ``uint16`` when every id fits (a vocabulary of at most 65,536), else ``uint32``;
- ``offsets.bin``: little-endian ``int64``, documents + 1 entries: document i is
  ``tokens[offsets[i]:offsets[i + 1]]``, its EOS last;
- ``tokenizer.json``: the tokenizer it was made with;
- ``meta.json``: what the files hold (``format``, dtype, counts), the tokenizer (source, sha256, vocabulary
  size, EOS) and the source files (path, bytes, sha256, documents). It is written last and the directory
  is renamed into place whole, so a directory with ``meta.json`` is complete.

The entry ``jobs.data.tokens:tokens`` (``data.entry``, ``data.args.path``) memory-maps the tokens: training
windows of ``seq_len + 1`` tokens drawn anywhere in the training documents as a pure function of (seed, step),
held-out windows tiling a seeded set of whole documents, and the vocabulary checked against the model's
(``jobs.train.layout.check_token_set``, run by ``hpc run``, ``--dry-run`` too, and ``hpc submit`` before any
rank starts, and by the entry). A set is checked whole when it is opened (``TokenSet``): ``meta.json``'s fields,
the files' sizes against its counts, offsets that run from 0 to the token count without decreasing, and every id
below the vocabulary it declares (one pass over ``tokens.bin``, a chunk at a time); what does not hold is one
line naming the file and the field, never an ``IndexError`` at a training step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hpc.errors import ConfigError
from jobs.data.datasets import DataSplits, window_starts

if TYPE_CHECKING:
    import torch

    from hpc.config import JobSpec

FORMAT = "hpc-tokens"
VERSION = 1
META, TOKENS, OFFSETS, TOKENIZER = "meta.json", "tokens.bin", "offsets.bin", "tokenizer.json"
OFFSET_DTYPE = "<i8"
TOKEN_DTYPES = ("uint8", "uint16", "uint32", "uint64")  # what tokens.dtype may say; hpc data prepare writes uint16/32
SCAN_TOKENS = 1 << 24  # ids read at a time when a set's largest id is looked for
TOKENS_ENTRY = "jobs.data.tokens:tokens"  # data.entry of a set hpc data prepare wrote
GPT_ENTRY = "jobs.models.gpt:gpt"


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
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ConfigError(f"{key}={str(path)!r}: {META} is not JSON ({type(exc).__name__}: "
                          f"{' '.join(str(exc).split())[:200]})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ConfigError(f"{key}={str(path)!r}: {META} is not {FORMAT} version {VERSION}")
    return meta


def meta_field(meta: dict[str, Any], dotted: str, path: str | Path, kind: str = "count") -> Any:
    """``meta[a][b]`` for ``dotted`` = "a.b", checked to be a ``kind`` of :data:`META_KINDS`; one line naming the
    field of ``meta.json`` when it is missing or of another kind."""
    value: Any = meta
    parts = dotted.split(".")
    for depth, part in enumerate(parts):
        if not isinstance(value, dict):
            raise _bad_meta(path, f"{'.'.join(parts[:depth])} is {_shown(value)}, not a table (it needs {dotted})")
        if part not in value:
            raise _bad_meta(path, f"has no {dotted}")
        value = value[part]
    wanted, fits = META_KINDS[kind]
    if not fits(value):
        raise _bad_meta(path, f"{dotted} is {_shown(value)}, not {wanted}")
    return value


META_KINDS = {  # kind -> (what it is, the test)
    "count": ("a count (an integer >= 0)", lambda v: type(v) is int and v >= 0),
    "size": ("a positive integer", lambda v: type(v) is int and v > 0),
    "dtype": (f"an unsigned integer type ({', '.join(TOKEN_DTYPES)})", lambda v: v in TOKEN_DTYPES),
}


def _shown(value: Any) -> str:
    return "null" if value is None else repr(value) if len(repr(value)) <= 40 else f"a {type(value).__name__}"


def _bad_meta(path: str | Path, problem: str) -> ConfigError:
    return ConfigError(f"data.args.path={str(path)!r}: {META} {problem} (not as hpc data prepare writes it)")


def check_vocab(meta: dict[str, Any], path: str | Path, vocab_size: int | None,
                where: str = "vocabulary") -> None:
    """Raise when the set's ids can reach past the model's vocabulary (``where`` says whose it is)."""
    ids = meta_field(meta, "tokenizer.vocab_size", path, "size")
    if vocab_size is not None and ids > vocab_size:
        fix = (f"model.entry = {GPT_ENTRY!r} with model.args.vocab_size = {ids} (jobs/examples/gpt_tokens.toml)"
               if "model.kind" in where else f"a model with a vocabulary of at least {ids:,}")
        raise ConfigError(f"data.args.path={str(path)!r} was tokenized with {ids:,} ids "
                          f"({meta['tokenizer'].get('source', 'tokenizer')}), more than the model's {where} of "
                          f"{vocab_size:,}: train {fix}")


def model_window(spec: JobSpec) -> tuple[int, int | None, str]:
    """The model's window length, its vocabulary as the spec says it (None when it does not) and whose it is."""
    model = spec.model
    if not model.entry:
        return model.seq_len, model.vocab_size, f"vocabulary (model.kind={model.kind!r} reads bytes)"
    vocab = model.args.get("vocab_size")
    seq_len = _positive(model.args.get("seq_len", model.seq_len), "model.args.seq_len")
    return seq_len, None if vocab is None else _positive(vocab, "model.args.vocab_size"), \
        "vocabulary (model.args.vocab_size)"


def _positive(value: Any, key: str) -> int:
    if type(value) is not int or value < 1:
        raise ConfigError(f"{key}={_shown(value)} must be a positive integer")
    return value


def entry_args(spec: JobSpec) -> dict[str, Any]:
    """``tokens``'s keyword arguments for ``spec``: the model's ``seq_len`` and ``vocab_size``, then ``data.args``."""
    if "vocab_size" in spec.data.args:
        raise ConfigError("data.args.vocab_size: the token set is checked against the model's own vocabulary "
                          "(model.args.vocab_size); leave it out")
    seq_len, vocab, _ = model_window(spec)
    return {"seq_len": seq_len, **dict(spec.data.args), "vocab_size": vocab}


class TokenSet:
    """A prepared directory, memory-mapped: ``tokens`` and ``offsets`` as read-only numpy arrays, checked whole
    when opened: ``meta.json``'s fields, the files' sizes, offsets that tile the tokens, every id within the
    vocabulary ``meta.json`` declares (one pass over the file, remembered for the process)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.meta = meta = read_meta(path)
        documents = meta_field(meta, "documents", path)
        count, dtype = meta_field(meta, "tokens.count", path), meta_field(meta, "tokens.dtype", path, "dtype")
        vocab = meta_field(meta, "tokenizer.vocab_size", path, "size")
        if "offsets" in meta and meta_field(meta, "offsets.count", path) != documents + 1:
            raise _bad_meta(path, f"says offsets.count={meta['offsets']['count']} for {documents} documents")
        self.tokens = _map(self.path / TOKENS, np.dtype(dtype).newbyteorder("<"), count, path, "tokens.count")
        self.offsets = _map(self.path / OFFSETS, np.dtype(OFFSET_DTYPE), documents + 1, path, "documents + 1")
        _check_offsets(self.offsets, count, path)
        _check_ids(self.tokens, vocab, path)

    @property
    def documents(self) -> int:
        return len(self.offsets) - 1

    def document(self, index: int) -> np.ndarray:
        """Document ``index``'s ids, its EOS last."""
        return self.tokens[self.offsets[index]: self.offsets[index + 1]]


def _map(file: Path, dtype: np.dtype, count: int, path: str | Path, what: str) -> np.ndarray:
    if not file.is_file():
        raise ConfigError(f"data.args.path={str(path)!r}: {file.name} is "
                          f"{'not a file' if file.exists() else 'missing'} (not as hpc data prepare writes it)")
    size = file.stat().st_size
    if size != count * dtype.itemsize:
        raise ConfigError(f"data.args.path={str(path)!r}: {file.name} holds {size:,} bytes, {META} says "
                          f"{count:,} ({what}) x {dtype.itemsize} ({dtype.name})")
    if count == 0:
        return np.zeros(0, dtype)
    try:
        return np.memmap(file, dtype=dtype, mode="r", shape=(count,))
    except OSError as exc:
        raise ConfigError(f"data.args.path={str(path)!r}: cannot read {file.name} ({exc.strerror or exc})") from None


def _check_offsets(offsets: np.ndarray, count: int, path: str | Path) -> None:
    """Document i is ``tokens[offsets[i]:offsets[i + 1]]``: the offsets start at 0, never decrease and end at
    the token count; read ``SCAN_TOKENS`` at a time."""
    first, last = int(offsets[0]), int(offsets[-1])
    if first != 0 or last != count:
        raise ConfigError(f"data.args.path={str(path)!r}: {OFFSETS} runs from {first:,} to {last:,}, not from 0 to "
                          f"the {count:,} tokens of {TOKENS}")
    for begin in range(0, len(offsets) - 1, SCAN_TOKENS):
        steps = np.diff(offsets[begin: begin + SCAN_TOKENS + 1])
        if (steps < 0).any():
            at = begin + int(np.argmax(steps < 0)) + 1
            raise ConfigError(f"data.args.path={str(path)!r}: {OFFSETS} decreases at entry {at:,} "
                              f"({int(offsets[at - 1]):,}, then {int(offsets[at]):,})")


_SCANNED: dict[tuple[int, int, int, int], int] = {}  # (device, inode, size, mtime_ns) of a tokens.bin -> its max id


def _check_ids(tokens: np.ndarray, vocab: int, path: str | Path) -> None:
    """Every id below ``vocab`` (``tokenizer.vocab_size``): the file's largest id, found once a process."""
    if not len(tokens):
        return
    info = (Path(path) / TOKENS).stat()
    key = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
    if key not in _SCANNED:
        _SCANNED[key] = max(int(tokens[i: i + SCAN_TOKENS].max()) for i in range(0, len(tokens), SCAN_TOKENS))
    if _SCANNED[key] >= vocab:
        at = next(i + int(np.argmax(tokens[i: i + SCAN_TOKENS] >= vocab))
                  for i in range(0, len(tokens), SCAN_TOKENS) if (tokens[i: i + SCAN_TOKENS] >= vocab).any())
        raise ConfigError(f"data.args.path={str(path)!r}: {TOKENS} holds id {int(tokens[at]):,} at token {at:,}, "
                          f"past the vocabulary of {vocab:,} that {META} declares (tokenizer.vocab_size)")


def held_out_documents(documents: int, fraction: float, seed: int) -> np.ndarray:
    """A boolean mask of the held-out documents: ``round(fraction * documents)`` of them (at least one when
    ``fraction`` > 0, never all), drawn by ``seed`` alone so every job seed evaluates on the same ones."""
    if type(fraction) not in (int, float) or not 0 <= fraction < 1:
        raise ConfigError(f"data.args.held_out={_shown(fraction)} must be a number in [0, 1)")
    if type(seed) is not int or seed < 0:
        raise ConfigError(f"data.args.split_seed={_shown(seed)} must be an integer >= 0")
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
        return window_starts(self.size, batch_size, self.seq_len, seed, step) // self.stride


def tokens(path: str, seq_len: int, vocab_size: int | None = None, held_out: float = 0.01,
           split_seed: int = 0) -> DataSplits:
    """The ``jobs.data.tokens:tokens`` entry: training windows drawn from the documents not held out, held-out
    windows tiling the ``held_out`` fraction of whole documents (``held_out = 0``: none). ``seq_len`` and
    ``vocab_size`` default to the model's (``entry_args``)."""
    if not isinstance(path, str):
        raise ConfigError(f"data.args.path={_shown(path)} must be the directory hpc data prepare wrote")
    seq_len = _positive(seq_len, "model.seq_len")
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
