"""The o200k_base vocabulary file smg's harmony encoding needs, without the network.

smg (gRPC mode) registers a gpt-oss worker only once its harmony encoding (o200k_harmony, on
top of OpenAI's `o200k_base.tiktoken`) has loaded; it downloads the file from OpenAI's public
blob store unless `TIKTOKEN_ENCODINGS_BASE` names a directory that holds it, and it checks
the file's SHA-256 either way. On a machine without that network (CI, this project's test
hosts) the file is rebuilt from the same vocabulary as shipped in the PyPI package
`quicktok-v1` (0.4.0, `quicktok/data/o200k.vocab`: a u32 count, then per token a u16 length,
its bytes and its u32 rank, little-endian) and used only if its digest is the published one.

`harmony_vocab_env()` returns the environment for a router process: `TIKTOKEN_ENCODINGS_BASE`
(an existing setting is kept), or {} when neither it nor quicktok-v1 is there.

`decode-worker harmony-vocab --out DIR` (`run`) writes the verified file into DIR for an
operator: from quicktok-v1, or from `--from FILE` (a copy fetched where there is network);
then `TIKTOKEN_ENCODINGS_BASE=DIR` for smg.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.util
import os
import struct
from pathlib import Path
from typing import Any

from decode_worker.errors import ConfigError

VOCAB_NAME = "o200k_base.tiktoken"
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
VOCAB_URL = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
CACHE_DIR = Path.home() / ".cache" / "decode-worker" / "tiktoken"


def tiktoken_text(vocab: bytes) -> bytes:
    """quicktok's binary vocabulary as a `.tiktoken` file: `base64(token) rank` lines in rank
    order. Raises ValueError for a truncated or inconsistent file."""
    (count,), offset, rows = struct.unpack_from("<I", vocab, 0), 4, []
    try:
        while offset < len(vocab):
            (length,) = struct.unpack_from("<H", vocab, offset)
            token = vocab[offset + 2:offset + 2 + length]
            (rank,) = struct.unpack_from("<I", vocab, offset + 2 + length)
            rows.append((rank, token))
            offset += 6 + length
    except struct.error as exc:
        raise ValueError(f"truncated vocabulary at byte {offset}") from exc
    if len(rows) != count:
        raise ValueError(f"vocabulary lists {count} tokens, holds {len(rows)}")
    return b"".join(base64.b64encode(tok) + b" %d\n" % rank for rank, tok in sorted(rows))


def ensure_vocab(cache_dir: Path = CACHE_DIR) -> Path | None:
    """A directory holding a verified `o200k_base.tiktoken` (built once from quicktok-v1), or
    None when quicktok-v1 is not installed or its vocabulary does not hash to the published
    digest."""
    target = cache_dir / VOCAB_NAME
    if target.is_file() and _verified(target.read_bytes()):
        return cache_dir
    text = quicktok_vocab()
    if text is None:
        return None
    _write(cache_dir, text)
    return cache_dir


def quicktok_vocab() -> bytes | None:
    """The verified `.tiktoken` text rebuilt from quicktok-v1, or None (not installed, or its
    vocabulary does not hash to the published digest)."""
    spec = importlib.util.find_spec("quicktok")
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(next(iter(spec.submodule_search_locations))) / "data" / "o200k.vocab"
    try:
        text = tiktoken_text(source.read_bytes())
    except (OSError, ValueError):
        return None
    return text if _verified(text) else None


def _verified(text: bytes) -> bool:
    return hashlib.sha256(text).hexdigest() == VOCAB_SHA256


def _write(directory: Path, text: bytes) -> Path:
    """`directory/o200k_base.tiktoken` written atomically (a concurrent reader sees the old
    file or the whole new one). Raises OSError."""
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / VOCAB_NAME
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(text)
    tmp.replace(target)
    return target


def write_vocab_dir(out: Path, source: Path | None = None) -> Path:
    """Write the verified vocabulary into `out` (created if missing) from `source` (a
    `.tiktoken` file) or quicktok-v1; returns the file. Raises `ConfigError` naming what is
    wrong: `out` not a writable directory, `source` unreadable or not the published file,
    quicktok-v1 missing."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a directory")
    if source is not None:
        try:
            text = source.read_bytes()
        except OSError as exc:
            raise ConfigError(f"--from {source}: cannot read it: {exc.strerror}") from None
        if not _verified(text):
            raise ConfigError(f"--from {source}: not {VOCAB_NAME} (its SHA-256 is not the "
                              f"published {VOCAB_SHA256[:12]}...; get it from {VOCAB_URL})")
    else:
        found = quicktok_vocab()
        if found is None:
            raise ConfigError("no vocabulary to write: install quicktok-v1 (pip install "
                              f"quicktok-v1==0.4.0) or give --from FILE, a copy of {VOCAB_URL} "
                              "fetched where there is network")
        text = found
    try:
        return _write(out, text)
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot write {VOCAB_NAME} there: "
                          f"{exc.strerror or exc}") from None


def run(args: argparse.Namespace, loaded: Any) -> int:
    """`decode-worker harmony-vocab --out DIR [--from FILE]`; the last line is the setting."""
    target = write_vocab_dir(args.out, args.source)
    print(f"wrote {target} (SHA-256 {VOCAB_SHA256}, the published o200k_base)")
    print(f"export TIKTOKEN_ENCODINGS_BASE={target.parent.resolve()}")
    return 0


def harmony_vocab_env() -> dict[str, str]:
    """`TIKTOKEN_ENCODINGS_BASE` for a router process, or {} (see the module docstring)."""
    if os.environ.get("TIKTOKEN_ENCODINGS_BASE"):
        return {"TIKTOKEN_ENCODINGS_BASE": os.environ["TIKTOKEN_ENCODINGS_BASE"]}
    found = ensure_vocab()
    return {} if found is None else {"TIKTOKEN_ENCODINGS_BASE": str(found)}
