"""A tiny gpt-oss in o200k_harmony's id space, for smg's harmony pipeline in gRPC mode.

smg renders gpt-oss chat and Responses prompts with its harmony encoding (o200k_harmony ids up
to 201087, `<|start|>` = 200006, ...) and sends only ids. The built-in tiny model has 264 ids,
so the worker refuses those prompts. This one is the same seeded tiny model with a
201088-row embedding and head (openai/gpt-oss-20b's `vocab_size`), the harmony special tokens
at their o200k ids, and a byte-level tokenizer padded with reserved entries: the worker takes
every id smg sends. Its own text rendering is byte-level (not o200k's merges), so its HTTP
chat is not token-equal to smg's; random weights write no harmony structure, so parsed
content stays empty.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from decode_worker.device.default_model import _bytes_to_unicode, write_model

VOCAB_SIZE = 201088
# o200k_harmony's special tokens (the openai-harmony encoding's table)
HARMONY_IDS = {"<|startoftext|>": 199998, "<|endoftext|>": 199999, "<|return|>": 200002,
               "<|constrain|>": 200003, "<|channel|>": 200005, "<|start|>": 200006,
               "<|end|>": 200007, "<|message|>": 200008, "<|call|>": 200012}


def write_o200k_model(out_dir: Path, seed: int = 0) -> Path:
    """The model directory (config, weights, tokenizer) under `out_dir`."""
    write_model(out_dir, seed=seed, vocab_size=VOCAB_SIZE, eos_token_id=HARMONY_IDS[
        "<|endoftext|>"])
    _tokenizer().save(str(out_dir / "tokenizer.json"))
    stops = [HARMONY_IDS[t] for t in ("<|return|>", "<|endoftext|>", "<|call|>")]
    (out_dir / "generation_config.json").write_text(
        json.dumps({"eos_token_id": stops, "do_sample": False}) + "\n")
    cfg = json.loads((out_dir / "tokenizer_config.json").read_text())
    cfg.update(eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out_dir


def _tokenizer() -> HFTokenizer:
    alphabet = _bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    names = {i: t for t, i in HARMONY_IDS.items()}
    vocab.update({names.get(i, f"<|reserved_{i}|>"): i for i in range(256, VOCAB_SIZE)})
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_IDS])
    return tok
