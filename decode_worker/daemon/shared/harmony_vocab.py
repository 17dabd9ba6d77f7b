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
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import struct
from pathlib import Path

VOCAB_NAME = "o200k_base.tiktoken"
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
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
    if target.is_file() and hashlib.sha256(target.read_bytes()).hexdigest() == VOCAB_SHA256:
        return cache_dir
    spec = importlib.util.find_spec("quicktok")
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(next(iter(spec.submodule_search_locations))) / "data" / "o200k.vocab"
    try:
        text = tiktoken_text(source.read_bytes())
    except (OSError, ValueError):
        return None
    if hashlib.sha256(text).hexdigest() != VOCAB_SHA256:
        return None
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(text)
    tmp.replace(target)  # atomic: a concurrent reader sees the old file or the whole new one
    return cache_dir


def harmony_vocab_env() -> dict[str, str]:
    """`TIKTOKEN_ENCODINGS_BASE` for a router process, or {} (see the module docstring)."""
    if os.environ.get("TIKTOKEN_ENCODINGS_BASE"):
        return {"TIKTOKEN_ENCODINGS_BASE": os.environ["TIKTOKEN_ENCODINGS_BASE"]}
    found = ensure_vocab()
    return {} if found is None else {"TIKTOKEN_ENCODINGS_BASE": str(found)}
