"""``hpc data prepare``: text, JSONL or Parquet files tokenized into a token set (the format: ``jobs/data/tokens.py``).

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
so an interrupted or failed run leaves no ``OUT`` (and removes its temporary directory and any parent it
made; one a killed run left is removed by the next run). The same inputs give byte-identical files.

Never deletes what it did not write: ``OUT`` must not exist, or with ``force`` be a set a previous run wrote
(a directory of only ``OUT_FILES``, its ``meta.json`` of format ``hpc-tokens``); it must not be, hold or lie
inside an input. Anything else, an input that cannot be read, a write that fails (a full disk, a file size
limit) and an input of no documents are one ``ConfigError`` naming the path, before or instead of ``OUT``.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import json
import os
import re
import secrets
import stat
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from hpc.config import show_path
from hpc.errors import ConfigError
from hpc.rundir import fsync_path
from jobs.data.tokens import FORMAT, META, OFFSET_DTYPE, OFFSETS, TOKENIZER, TOKENS, VERSION, token_dtype

CHUNK_CHARS = 1 << 20  # characters of documents per encode_batch call
AHEAD = 2  # chunks read ahead, and encoded chunks waiting to be written
BLOCK_BYTES = 1 << 20  # bytes per read
KNOWN_EOS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
BLANK_LINES = re.compile(rb"\r?\n(?:[ \t\r\f\v]*\n)+")
DOCUMENTS = {"text": "paragraphs: separated by blank lines", "jsonl": "lines: the field {}",
             "parquet": "rows: the column {}"}
OUT_FILES = frozenset({META, TOKENS, OFFSETS, TOKENIZER})  # all a set holds: --force replaces nothing else
NAME_MAX = 255  # bytes of one file name (Linux file systems)
SUFFIX = ".tmp-{pid}-XXXXXXXX"  # what mkdtemp adds to OUT's name (and .old-{pid}-XXXXXXXX the one replaced)
SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")  # a JSON line that may decode to a lone surrogate
HINTS = {errno.EFBIG: "past the file size limit? ulimit -f", errno.ENOSPC: "the disk is full",
         errno.EDQUOT: "the disk quota is used up", errno.EPERM: "an immutable directory?"}


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
    if eos is not None and not eos:
        raise ConfigError(f"--eos '': no token named (give a token of --tokenizer {show_path(source)}, or leave "
                          "--eos out for the tokenizer's own)")
    file, text = _read_tokenizer(source)
    try:
        tokenizer = HfTokenizer.from_str(text.decode())
    except Exception as exc:  # tokenizers raises a bare Exception on a bad file
        raise ConfigError(f"--tokenizer {show_path(source)}: not a tokenizers tokenizer.json "
                          f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    name, origin = (eos, "--eos") if eos else configured_eos(file.parent) or (known_eos(tokenizer), "special token")
    if name is None:
        raise ConfigError(f"--tokenizer {show_path(source)} names no end-of-document token (no eos_token in "
                          f"tokenizer_config.json, no special token {' '.join(KNOWN_EOS)}): give --eos TOKEN")
    eos_id = tokenizer.token_to_id(name)
    if eos_id is None:
        fix = "" if eos else ": give --eos TOKEN"
        raise ConfigError(f"{origin} {name!r} is not a token of --tokenizer {show_path(source)}{fix}")
    vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
    return Tokenizer(tokenizer, text, source, vocab_size, name, eos_id)


def _read_tokenizer(source: str) -> tuple[Path, bytes]:
    """The ``tokenizer.json`` ``source`` names and its bytes; one line when there is none or it cannot be read."""
    path = Path(source)
    try:
        file = path / TOKENIZER if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(f"--tokenizer {show_path(source)}: " + (
                "no tokenizer.json in that directory (a transformers tokenizer saves one: "
                "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))" if path.is_dir()
                else "no such file or directory"))
        return file, file.read_bytes()
    except OSError as exc:
        raise ConfigError(f"--tokenizer {show_path(source)}: cannot read it ({_reason(exc)})") from None


def configured_eos(directory: Path) -> tuple[str, str] | None:
    """``eos_token`` of transformers' ``tokenizer_config.json`` or ``special_tokens_map.json`` in ``directory``,
    and where it was found (``FILE: eos_token``, as an error names it)."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            value = json.loads((directory / name).read_text()).get("eos_token")
        except (OSError, ValueError, AttributeError, RecursionError):
            continue
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str) and value:
            return value, f"{show_path(directory / name)}: eos_token"
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
    """Every file exists, is a file this process can open and can be read as its kind (Parquet: pyarrow, and the
    column) before anything is written."""
    sources = []
    for name in files:
        path = Path(name)
        try:
            info = os.stat(path)
        except OSError as exc:
            what = "no such file" if exc.errno == errno.ENOENT else _reason(exc)
            raise ConfigError(f"{show_path(name)}: {what}") from None
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{show_path(name)}: " + ("is a directory (give its files)" if stat.S_ISDIR(info.st_mode)
                                                        else f"is {_kind(info.st_mode)}, not a file"))
        try:
            open(path, "rb").close()
        except OSError as exc:
            raise ConfigError(f"{show_path(name)}: cannot read it ({_reason(exc)})") from None
        suffix = path.suffix.lower()
        kind = "parquet" if suffix == ".parquet" else "jsonl" if suffix in JSONL_SUFFIXES else "text"
        if kind == "parquet":
            _check_parquet(path, text_field)
        sources.append(Source(path, kind, info.st_size))
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
    of a block waits for the next block, which may continue it. A read error is one line naming the file."""
    pending, done = b"", 0
    try:
        handle = open(source.path, "rb")
    except OSError as exc:
        raise _read_error(source, exc, done) from None
    with handle:
        while True:
            try:
                block = handle.read(BLOCK_BYTES)
            except OSError as exc:
                raise _read_error(source, exc, done) from None
            if not block:
                break
            source.hasher.update(block)
            advance(len(block))
            done += len(block)
            pieces = split(pending + block)
            pending = pieces.pop()
            yield from pieces
    yield pending


def _read_error(source: Source, exc: OSError, offset: int) -> ConfigError:
    return ConfigError(f"{show_path(source.path)}: cannot read it ({_reason(exc)}, at byte {offset:,})")


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
        except RecursionError:
            raise ConfigError(f"{show_path(source.path)}:{number}: JSON nested too deep to read") from None
        except ValueError as exc:
            raise ConfigError(f"{show_path(source.path)}:{number}: not JSON ({getattr(exc, 'msg', exc)})") from None
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            what = "no field" if text is None else f"{type(text).__name__}, not text, in the field"
            raise ConfigError(f"{show_path(source.path)}:{number}: {what} {text_field!r} (another field: --field NAME)")
        if SURROGATE.search(line):  # json decodes \ud800 (and CESU-8 bytes) to what no encoder takes
            _check_unicode(text, f"{show_path(source.path)}:{number}: the field {text_field!r}")
        yield text


def _check_unicode(text: str, where: str) -> None:
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise ConfigError(f"{where} holds a lone surrogate {text[exc.start]!r} at character {exc.start:,}, "
                          "not Unicode text") from None


def parquet_documents(source: Source, advance: Callable[[int], None], text_field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with open(source.path, "rb") as handle:
            source.hasher = hashlib.file_digest(handle, "sha256")
        file = pq.ParquetFile(source.path)
        rows, done = max(file.metadata.num_rows, 1), 0
        for batch in file.iter_batches(batch_size=1024, columns=[text_field]):
            for row, text in enumerate(batch.column(0).to_pylist(), done + 1):
                if not isinstance(text, str):
                    raise ConfigError(f"{show_path(source.path)}: row {row}: column {text_field!r} holds "
                                      f"{'null' if text is None else type(text).__name__}, not text")
                yield text
            advance(source.size * (done + batch.num_rows) // rows - source.size * done // rows)
            done += batch.num_rows
    except (OSError, pa.ArrowException) as exc:  # pyarrow's errors on a damaged file
        raise ConfigError(f"{show_path(source.path)}: cannot read it as Parquet ({exc})") from None


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
        try:
            self.offsets = open(directory / OFFSETS, "wb")
        except OSError:
            self.tokens.close()
            raise
        _write(self.offsets, np.zeros(1, OFFSET_DTYPE).tobytes())

    def append(self, encodings: Sequence[Any]) -> None:
        ids = [encoding.ids for encoding in encodings]
        for doc in ids:
            doc.append(self.eos_id)
        ends = self.count + np.cumsum(np.fromiter(map(len, ids), np.int64, len(ids)))
        _write(self.tokens, np.fromiter(chain.from_iterable(ids), self.dtype, int(ends[-1]) - self.count).tobytes())
        _write(self.offsets, ends.astype(OFFSET_DTYPE).tobytes())
        self.count, self.documents = int(ends[-1]), self.documents + len(ids)

    def close(self, sync: bool) -> None:
        """Both files closed whatever fails (fsynced first with ``sync``); the first error raised after."""
        failed = None
        for handle in (self.tokens, self.offsets):
            try:
                if sync and not handle.closed:
                    _write(handle, b"")
                    os.fsync(handle.fileno())
                handle.close()
            except OSError as exc:
                failed = failed or _named(exc, handle.name)
                with suppress(OSError):
                    handle.close()
        if failed is not None:
            raise failed


def _write(handle: Any, data: bytes) -> None:
    """``handle.write(data)`` and a flush; an OSError names the file (write() says File too large, not where)."""
    try:
        handle.write(data)
        handle.flush()
    except OSError as exc:
        raise _named(exc, handle.name) from None


def _named(exc: OSError, name: str) -> OSError:
    if exc.filename is None:
        exc.filename = name
    return exc


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
        _write(handle, data)
        try:
            os.fsync(handle.fileno())
        except OSError as exc:
            raise _named(exc, str(path)) from None


def write_set(directory: Path, tokenizer: Tokenizer, sources: list[Source], text_field: str,
              advance: Callable[[int], None]) -> dict[str, Any]:
    """The set's files in ``directory``, fsynced, ``meta.json`` last; returns the metadata."""
    dtype = token_dtype(tokenizer.vocab_size)
    writer = TokenWriter(directory, dtype, tokenizer.eos_id)
    try:
        encode_all(tokenizer.tokenizer, chunks(sources, text_field, advance), writer)
    except BaseException:
        with suppress(OSError):
            writer.close(sync=False)
        raise
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


# --- where the set goes: OUT checked before anything is written, and nothing deleted that a run did not write ---


def check_out(out: str | Path, sources: Sequence[Source], force: bool) -> Path:
    """``out`` as a path this run may write, checked before anything is: one line when it names no directory of
    its own, its name leaves no room for the temporary suffix, it is, holds or lies inside an input, a parent is
    not a directory, or it exists (with ``force``: unless it is a set a previous run wrote, replaced once the new
    one is complete)."""
    path = Path(out)
    if path.name in ("", ".", ".."):
        raise ConfigError(f"--out {show_path(out)}: names no directory of its own (give a new one, e.g. "
                          f"{show_path(path / 'tokens')})")
    limit = NAME_MAX - len(SUFFIX.format(pid=os.getpid()))
    if len(os.fsencode(path.name)) > limit:
        raise ConfigError(f"--out {show_path(out)}: its name is {len(os.fsencode(path.name))} bytes, longer than "
                          f"the {limit} that leave room for the suffix {SUFFIX.format(pid=os.getpid())} of the "
                          f"temporary directory (a name may have {NAME_MAX})")
    _check_inputs(path, sources)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return path
    except OSError as exc:
        raise _out_error(path, exc) from None
    problem = foreign(path, info)
    if problem is None and not force:
        raise ConfigError(f"--out {show_path(out)} exists: remove it, or --force to replace it")
    if problem is not None:
        raise ConfigError(f"--out {show_path(out)} exists and {problem}: choose another --out (--force replaces "
                          "only a token set that hpc data prepare wrote)")
    return path


def _check_inputs(out: Path, sources: Sequence[Source]) -> None:
    target = Path(os.path.realpath(out))
    for source in sources:
        real = Path(os.path.realpath(source.path))
        what = ("is" if real == target else "holds" if target in real.parents
                else "is inside" if real in target.parents else None)
        if what is not None:
            raise ConfigError(f"--out {show_path(out)} {what} the input file {show_path(source.path)}: write the "
                              "set elsewhere")


def foreign(path: Path, info: os.stat_result) -> str | None:
    """Why ``path`` (``info``: its lstat) is not a token set a previous run wrote, None when it is one: a directory,
    not a link, of regular files of ``OUT_FILES`` only, its ``meta.json`` JSON of format ``hpc-tokens``."""
    if not stat.S_ISDIR(info.st_mode):
        return f"is {_kind(info.st_mode)}, not a token set"
    try:
        names = sorted(os.listdir(path))
        kinds = {name: os.lstat(path / name).st_mode for name in names}
        meta = json.loads((path / META).read_bytes()) if META in names else None
    except (OSError, ValueError, RecursionError) as exc:
        return f"holds a {META} that is not JSON" if isinstance(exc, ValueError | RecursionError) \
            else f"cannot be read ({_reason(exc)})"
    extra = [name for name in names if name not in OUT_FILES]
    if not names:
        return "is an empty directory, not a token set"
    if extra:
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        return f"holds {show_path(extra[0])}{more}, which hpc data prepare does not write"
    odd = next((name for name in names if not stat.S_ISREG(kinds[name])), None)
    if odd is not None:
        return f"its {odd} is {_kind(kinds[odd])}, not the file hpc data prepare writes"
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return f"has no {META} of format {FORMAT!r}: not a token set"
    if os.path.samefile(path, os.curdir):
        return "is the current directory"
    return None


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a file"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a file")


def _reason(exc: OSError) -> str:
    text = exc.strerror or str(exc) or type(exc).__name__
    return f"{text}, {HINTS[exc.errno]}" if exc.errno in HINTS else text


def _out_error(out: Path, exc: OSError, doing: str = "") -> ConfigError:
    """One line for an OSError on ``out``: a parent that is a file is named."""
    if exc.errno == errno.ENOTDIR:
        parent = next((p for p in reversed(out.parents) if os.path.lexists(p) and not os.path.isdir(p)), None)
        if parent is not None:
            return ConfigError(f"--out {show_path(out)}: its parent {show_path(parent)} is "
                               f"{_kind(os.lstat(parent).st_mode)}, not a directory")
    return ConfigError(f"--out {show_path(out)}: {doing}{_reason(exc)}")


def make_temporary(out: Path) -> tuple[Path, list[Path]]:
    """``OUT.tmp-PID-*`` beside ``out`` and the parents made for it (to remove on failure), a killed run's
    leftovers removed first; one line naming ``out`` when it cannot be made."""
    made: list[Path] = []
    try:
        for parent in [*reversed(out.parent.parents), out.parent]:
            if not os.path.isdir(parent):
                os.mkdir(parent)
                made.append(parent)
        remove_stale(out)
        return Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-{os.getpid()}-", dir=out.parent)), made
    except OSError as exc:
        remove_made(made)
        where = os.path.dirname(exc.filename) or os.curdir if exc.filename is not None else out.parent
        raise _out_error(out, exc, f"cannot create a directory in {show_path(where)}: ") from None


def remove_made(made: Sequence[Path]) -> None:
    """The parents ``make_temporary`` made, deepest first, while they are empty."""
    for parent in reversed(made):
        try:
            os.rmdir(parent)
        except OSError:
            return


def remove_set(directory: Path) -> bool:
    """Delete the files a run writes in ``directory``, then the directory if nothing else is in it (never
    anything else, never through a link); whether it is gone."""
    if os.path.islink(directory) or not os.path.isdir(directory):
        return False
    for name in OUT_FILES:
        with suppress(OSError):
            if stat.S_ISREG(os.lstat(directory / name).st_mode):
                os.unlink(directory / name)
    try:
        os.rmdir(directory)
    except OSError:
        return False
    return True


def remove_stale(out: Path) -> None:
    """Temporary directories of ``out`` that a killed run left (its process is gone)."""
    for stale in out.parent.glob(f"{glob.escape(out.name)}.tmp-*"):
        pid = stale.name[len(out.name) + len(".tmp-"):].partition("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            remove_set(stale)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def publish(tmp: Path, out: Path, force: bool) -> None:
    """Rename the finished ``tmp`` to ``out``; with ``force``, in place of the set there (checked again: it is
    still one a previous run wrote), its files removed after."""
    old = None
    if os.path.lexists(out):
        problem = foreign(out, os.lstat(out)) if force else "exists"
        if problem is not None:
            raise ConfigError(f"--out {show_path(out)} appeared while this run prepared it, and {problem}: "
                              "another run? left as it is")
        old = out.with_name(f"{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
        os.rename(out, old)
    try:
        os.rename(tmp, out)  # refuses a non-empty out: another run's set stays whole
    except OSError as exc:
        kept = f"; the set that was there is now {show_path(old)}" if old is not None else ""
        raise ConfigError(f"--out {show_path(out)} appeared while this run prepared it ({exc.strerror}): another "
                          f"run?{kept}") from None
    fsync_path(out.parent)
    if old is not None and not remove_set(old):
        raise ConfigError(f"--out {show_path(out)} is written, but the set it replaced, now {show_path(old)}, holds "
                          "files hpc data prepare did not write meanwhile: left there")


def prepare(files: Sequence[str | Path], tokenizer: str, out: str | Path, text_field: str = "text",
            eos: str | None = None, force: bool = False, progress: bool = False) -> dict[str, Any]:
    """Tokenize ``files`` into the directory ``out`` (see the module's docstring); returns its metadata.

    Every check that can fail before reading (tokenizer, EOS, files, ``out``) runs first: nothing is written."""
    loaded = load_tokenizer(tokenizer, eos)
    sources = check_sources(files, text_field)
    out = check_out(out, sources, force)
    tmp, made = make_temporary(out)
    bar = _bar(sum(source.size for source in sources), progress)
    try:
        meta = write_set(tmp, loaded, sources, text_field, bar.update)
        if not meta["documents"]:
            names = ", ".join(show_path(source.path) for source in sources[:3])
            raise ConfigError(f"{names}{', ...' * (len(sources) > 3)}: no documents (empty, or blank lines only): "
                              f"nothing to train on, --out {show_path(out)} not written")
        publish(tmp, out, force)
    except BaseException as exc:
        remove_set(tmp)
        remove_made(made)
        if isinstance(exc, OSError):
            name = Path(exc.filename).name if exc.filename else "it"
            raise ConfigError(f"--out {show_path(out)}: cannot write {name} ({_reason(exc)})") from None
        raise
    finally:
        bar.close()
    return meta


def _bar(total: int, progress: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="tokenizing", ncols=100,
                file=sys.stderr, disable=not progress)
