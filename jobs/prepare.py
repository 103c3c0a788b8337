"""``hpc data prepare``: text, JSONL or Parquet files tokenized into a token set (the format: ``jobs/tokens.py``).

Documents:

- plain text (any suffix but the two below): documents are separated by blank lines (lines of only
  whitespace), so one paragraph is one document and a file of one paragraph is one document;
- JSONL (``.jsonl``, ``.ndjson``): one JSON object per line, the document its ``text`` field (``field``);
  blank lines are skipped;
- Parquet (``.parquet``, with pyarrow installed): one document per row of the ``text`` column (``field``).

Each document is encoded without the tokenizer's special tokens (no BOS), then its EOS id appended.

Streaming on every core: the main thread hands chunks of about ``CHUNK_CHARS`` characters of documents
to the tokenizer's ``encode_batch_fast`` (Rust, Rayon on all cores, the GIL released; the same ids as
``encode_batch`` without character offsets) while a reader thread parses the next chunks (``AHEAD``) and
a writer thread appends the encoded ones to the files, in order. Memory holds a few chunks, whatever the
input size (a single document is held whole). Parsing and the ids' conversion run on one core under the
GIL, about 90 MB/s of the benchmark's JSONL here against about 5 MB/s per core for the example tokenizer's
``encode_batch``: past some twenty such cores they, not the tokenizer, would bound the rate.

Atomic: everything is written into ``OUT.tmp-<pid>-<random>`` beside ``OUT``, fsynced, and renamed to ``OUT``,
so an interrupted or failed run leaves no ``OUT`` (and removes its temporary directory; one a killed
run left is removed by the next run). The same inputs give byte-identical files.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from hpc.errors import ConfigError
from hpc.rundir import fsync_path
from jobs.tokens import FORMAT, META, OFFSET_DTYPE, OFFSETS, TOKENIZER, TOKENS, VERSION, token_dtype

CHUNK_CHARS = 1 << 20  # characters of documents per encode_batch call
AHEAD = 2  # chunks read ahead, and encoded chunks waiting to be written
BLOCK_BYTES = 1 << 20  # bytes per read
KNOWN_EOS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
BLANK_LINES = re.compile(rb"\r?\n(?:[ \t\r\f\v]*\n)+")
DOCUMENTS = {"text": "paragraphs: separated by blank lines", "jsonl": "lines: the field {}",
             "parquet": "rows: the column {}"}


@dataclass(frozen=True)
class Tokenizer:
    """A ``tokenizers.Tokenizer`` with what the set records of it."""

    tokenizer: Any
    json: bytes  # its tokenizer.json
    source: str
    vocab_size: int  # the largest id + 1
    eos: str
    eos_id: int


def load_tokenizer(source: str, eos: str | None = None) -> Tokenizer:
    """A ``tokenizer.json``, or a transformers tokenizer directory holding one; its EOS is ``eos``, else the
    ``eos_token`` of ``tokenizer_config.json`` (or ``special_tokens_map.json``) beside it, else a special
    token of ``KNOWN_EOS``."""
    try:
        from tokenizers import Tokenizer as HfTokenizer
    except ImportError:
        raise ConfigError("hpc data prepare needs Hugging Face tokenizers (pip install 'hpc-batch[data]')") from None
    path = Path(source)
    file = path / TOKENIZER if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"--tokenizer {source}: " + ("no tokenizer.json in that directory (a transformers "
                          "tokenizer saves one: AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))"
                          if path.is_dir() else "no such file or directory"))
    try:
        text = file.read_bytes()
        tokenizer = HfTokenizer.from_str(text.decode())
    except Exception as exc:  # tokenizers raises a bare Exception on a bad file
        raise ConfigError(f"--tokenizer {source}: not a tokenizers tokenizer.json ({str(exc).splitlines()[0]})") \
            from None
    name = eos or configured_eos(file.parent) or known_eos(tokenizer)
    if name is None:
        raise ConfigError(f"--tokenizer {source} names no end-of-document token (no eos_token in "
                          f"tokenizer_config.json, no special token {' '.join(KNOWN_EOS)}): give --eos TOKEN")
    eos_id = tokenizer.token_to_id(name)
    if eos_id is None:
        raise ConfigError(f"--eos {name!r} is not a token of --tokenizer {source}")
    vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
    return Tokenizer(tokenizer, text, source, vocab_size, name, eos_id)


def configured_eos(directory: Path) -> str | None:
    """``eos_token`` of transformers' ``tokenizer_config.json`` or ``special_tokens_map.json`` in ``directory``."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            value = json.loads((directory / name).read_text()).get("eos_token")
        except (OSError, ValueError, AttributeError):
            continue
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str) and value:
            return value
    return None


def known_eos(tokenizer: Any) -> str | None:
    special = {added.content for added in tokenizer.get_added_tokens_decoder().values() if added.special}
    return next((name for name in KNOWN_EOS if name in special), None)


@dataclass
class Source:
    """One input file and what reading it found: its bytes, their sha256, its documents."""

    path: Path
    kind: str  # text | jsonl | parquet
    size: int
    documents: int = 0
    hasher: Any = field(default_factory=hashlib.sha256)

    def record(self) -> dict[str, Any]:
        return {"path": str(self.path), "kind": self.kind, "bytes": self.size, "sha256": self.hasher.hexdigest(),
                "documents": self.documents}


def check_sources(files: Sequence[str | Path], text_field: str) -> list[Source]:
    """Every file exists and can be read as its kind (Parquet: pyarrow, and the column) before anything is written."""
    sources = []
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise ConfigError(f"{name}: " + ("is a directory (give its files)" if path.is_dir() else "no such file"))
        suffix = path.suffix.lower()
        kind = "parquet" if suffix == ".parquet" else "jsonl" if suffix in JSONL_SUFFIXES else "text"
        if kind == "parquet":
            _check_parquet(path, text_field)
        sources.append(Source(path, kind, path.stat().st_size))
    return sources


def _check_parquet(path: Path, text_field: str) -> None:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"{path} is Parquet: reading it needs pyarrow (pip install pyarrow)") from None
    try:
        names = pq.ParquetFile(path).schema_arrow.names
    except Exception as exc:  # pyarrow's ArrowInvalid and friends
        raise ConfigError(f"{path}: not a Parquet file ({exc})") from None
    if text_field not in names:
        raise ConfigError(f"{path}: no column {text_field!r} (columns: {', '.join(names)}): give --field NAME")


def _pieces(source: Source, split: Callable[[bytes], list[bytes]], advance: Callable[[int], None]) -> Iterator[bytes]:
    """The file's bytes cut by ``split``, read a block at a time (hashed and counted as read); the last piece
    of a block waits for the next block, which may continue it."""
    pending = b""
    with open(source.path, "rb") as handle:
        while block := handle.read(BLOCK_BYTES):
            source.hasher.update(block)
            advance(len(block))
            pieces = split(pending + block)
            pending = pieces.pop()
            yield from pieces
    yield pending


def text_documents(source: Source, advance: Callable[[int], None]) -> Iterator[str]:
    for number, piece in enumerate(_pieces(source, BLANK_LINES.split, advance), 1):
        piece = piece.strip(b"\r\n")
        if piece.strip():
            try:
                yield piece.decode()
            except UnicodeDecodeError as exc:
                raise ConfigError(f"{source.path}: paragraph {number} is not UTF-8 ({exc.reason} at its byte "
                                  f"{exc.start})") from None


def jsonl_documents(source: Source, advance: Callable[[int], None], text_field: str) -> Iterator[str]:
    for number, line in enumerate(_pieces(source, lambda data: data.split(b"\n"), advance), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise ConfigError(f"{source.path}:{number}: not JSON ({getattr(exc, 'msg', exc)})") from None
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            what = "no field" if text is None else f"{type(text).__name__}, not text, in the field"
            raise ConfigError(f"{source.path}:{number}: {what} {text_field!r} (another field: --field NAME)")
        yield text


def parquet_documents(source: Source, advance: Callable[[int], None], text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    with open(source.path, "rb") as handle:
        source.hasher = hashlib.file_digest(handle, "sha256")
    file = pq.ParquetFile(source.path)
    rows, done = max(file.metadata.num_rows, 1), 0
    for batch in file.iter_batches(batch_size=1024, columns=[text_field]):
        for row, text in enumerate(batch.column(0).to_pylist(), done + 1):
            if not isinstance(text, str):
                raise ConfigError(f"{source.path}: row {row}: column {text_field!r} holds "
                                  f"{'null' if text is None else type(text).__name__}, not text")
            yield text
        advance(source.size * (done + batch.num_rows) // rows - source.size * done // rows)
        done += batch.num_rows


def chunks(sources: Sequence[Source], text_field: str, advance: Callable[[int], None]) -> Iterator[list[str]]:
    """Documents of every source in order, about ``CHUNK_CHARS`` characters per list."""
    docs, chars = [], 0
    for source in sources:
        if source.kind == "text":
            documents = text_documents(source, advance)
        else:
            reader = jsonl_documents if source.kind == "jsonl" else parquet_documents
            documents = reader(source, advance, text_field)
        for doc in documents:
            docs.append(doc)
            chars += len(doc)
            source.documents += 1
            if chars >= CHUNK_CHARS:
                yield docs
                docs, chars = [], 0
    if docs:
        yield docs


class TokenWriter:
    """Appends encoded documents, each followed by the EOS id, to ``tokens.bin`` and their ends to ``offsets.bin``."""

    def __init__(self, directory: Path, dtype: str, eos_id: int) -> None:
        self.dtype, self.eos_id, self.count, self.documents = np.dtype(dtype).newbyteorder("<"), eos_id, 0, 0
        self.tokens = open(directory / TOKENS, "wb")
        self.offsets = open(directory / OFFSETS, "wb")
        self.offsets.write(np.zeros(1, OFFSET_DTYPE).tobytes())

    def append(self, encodings: Sequence[Any]) -> None:
        ids = [encoding.ids for encoding in encodings]
        for doc in ids:
            doc.append(self.eos_id)
        ends = self.count + np.cumsum(np.fromiter(map(len, ids), np.int64, len(ids)))
        self.tokens.write(np.fromiter(chain.from_iterable(ids), self.dtype, int(ends[-1]) - self.count).tobytes())
        self.offsets.write(ends.astype(OFFSET_DTYPE).tobytes())
        self.count, self.documents = int(ends[-1]), self.documents + len(ids)

    def close(self, sync: bool) -> None:
        for handle in (self.tokens, self.offsets):
            if sync and not handle.closed:
                handle.flush()
                os.fsync(handle.fileno())
            handle.close()


def encode_all(tokenizer: Any, batches: Iterator[list[str]], writer: TokenWriter) -> None:
    """While ``encode_batch`` encodes a chunk on every core, a reader thread parses up to ``AHEAD`` chunks
    ahead and a writer thread appends up to ``AHEAD`` encoded ones, in order."""
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # the same ids, no char offsets
    with ThreadPoolExecutor(1, "hpc-data-read") as reader, ThreadPoolExecutor(1, "hpc-data-write") as writing:
        reads = deque(reader.submit(next, batches, None) for _ in range(AHEAD))  # one thread: in order
        writes: deque[Future] = deque()
        try:
            while (docs := reads.popleft().result()) is not None:
                reads.append(reader.submit(next, batches, None))
                encodings = encode(docs, add_special_tokens=False)
                while len(writes) >= AHEAD:
                    writes.popleft().result()
                writes.append(writing.submit(writer.append, encodings))
            while writes:
                writes.popleft().result()
        except BaseException:
            for future in (*reads, *writes):
                future.cancel()
            raise


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def write_set(directory: Path, tokenizer: Tokenizer, sources: list[Source], text_field: str,
              advance: Callable[[int], None]) -> dict[str, Any]:
    """The set's files in ``directory``, fsynced, ``meta.json`` last; returns the metadata."""
    dtype = token_dtype(tokenizer.vocab_size)
    writer = TokenWriter(directory, dtype, tokenizer.eos_id)
    try:
        encode_all(tokenizer.tokenizer, chunks(sources, text_field, advance), writer)
    finally:
        writer.close(sync=True)
    _write_file(directory / TOKENIZER, tokenizer.json)
    meta = {
        "format": FORMAT, "version": VERSION, "documents": writer.documents,
        "tokens": {"file": TOKENS, "dtype": dtype, "count": writer.count},
        "offsets": {"file": OFFSETS, "dtype": "int64", "count": writer.documents + 1},
        "tokenizer": {"source": tokenizer.source, "file": TOKENIZER, "vocab_size": tokenizer.vocab_size,
                      "eos": tokenizer.eos, "eos_id": tokenizer.eos_id,
                      "sha256": hashlib.sha256(tokenizer.json).hexdigest()},
        "documents_are": {kind: what.format(repr(text_field)) for kind, what in DOCUMENTS.items()
                          if kind in {source.kind for source in sources}},
        "sources": [source.record() for source in sources],
    }
    _write_file(directory / META, (json.dumps(meta, indent=2) + "\n").encode())
    fsync_path(directory)
    return meta


def remove_stale(out: Path) -> None:
    """Temporary directories of ``out`` that a killed run left (its process is gone)."""
    for stale in out.parent.glob(f"{glob.escape(out.name)}.tmp-*"):
        pid = stale.name[len(out.name) + len(".tmp-"):].partition("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def publish(tmp: Path, out: Path, force: bool) -> None:
    """Rename the finished ``tmp`` to ``out`` (``force``: in place of the old one, removed after)."""
    old = None
    if force and out.exists():
        old = out.with_name(f"{out.name}.old-{os.getpid()}")
        os.rename(out, old)
    try:
        os.rename(tmp, out)  # refuses a non-empty out: another run's set stays whole
    except OSError as exc:
        raise ConfigError(f"--out {out} appeared while this run prepared it ({exc.strerror}): another run?") from None
    fsync_path(out.parent)
    if old is not None:
        shutil.rmtree(old)


def prepare(files: Sequence[str | Path], tokenizer: str, out: str | Path, text_field: str = "text",
            eos: str | None = None, force: bool = False, progress: bool = False) -> dict[str, Any]:
    """Tokenize ``files`` into the directory ``out`` (see the module's docstring); returns its metadata.

    Every check that can fail before reading (tokenizer, EOS, files, ``out``) runs first: nothing is written."""
    loaded = load_tokenizer(tokenizer, eos)
    sources = check_sources(files, text_field)
    out = Path(out)
    if out.exists() and not force:
        raise ConfigError(f"--out {out} exists: remove it, or --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    bar = _bar(sum(source.size for source in sources), progress)
    try:
        meta = write_set(tmp, loaded, sources, text_field, bar.update)
        publish(tmp, out, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
    return meta


def _bar(total: int, progress: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="tokenizing", ncols=100,
                file=sys.stderr, disable=not progress)
