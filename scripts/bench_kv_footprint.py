"""KV bytes one request holds, this worker's layout beside full KV in every layer.

For the real shapes of gpt-oss-20b and -120b, Gemma-3-27B, Qwen3-32B, Qwen3-30B-A3B and
Llama-3.1-8B (their public config.json values, in the hub's keys, read by this worker's own
model registry), at 8k, 32k and 128k tokens, bf16 KV:

- this worker: full-attention layers hold every token; sliding layers hold their window plus
  margin (`min_swa_pages_per_request`: the SWA tail the decode radix cache keeps, page-rounded);
- full KV in every layer: what SGLang keeps for Gemma 2/3, Mistral and Cohere2 (it applies
  their window only as an attention mask) and what any engine without SWA pools keeps.

Then how many 32k-token requests fit in 40 GiB of KV in each layout. Models without sliding
layers (Qwen3, Llama 3) hold the same either way. Pure arithmetic: no model is loaded.

Usage: python scripts/bench_kv_footprint.py [--page-size 16] [--budget-gib 40]
"""

from __future__ import annotations

import argparse
from typing import Any

GIB = 2**30
LENGTHS = (8192, 32768, 131072)
# public config.json values (hub keys); fields the KV layout does not depend on are left out
_GPT_OSS = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
            "hidden_size": 2880, "intermediate_size": 2880, "num_attention_heads": 64,
            "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
            "num_experts_per_tok": 4, "vocab_size": 201088}
MODELS: dict[str, dict[str, Any]] = {
    "gpt-oss-20b": {**_GPT_OSS, "num_hidden_layers": 24, "num_local_experts": 32},
    "gpt-oss-120b": {**_GPT_OSS, "num_hidden_layers": 36, "num_local_experts": 128},
    "Gemma-3-27B": {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                    "text_config": {
                        "model_type": "gemma3_text", "hidden_size": 5376, "head_dim": 128,
                        "intermediate_size": 21504, "num_attention_heads": 32,
                        "num_hidden_layers": 62, "num_key_value_heads": 16,
                        "query_pre_attn_scalar": 168, "sliding_window": 1024,
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}},
    "Qwen3-32B": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                  "hidden_size": 5120, "intermediate_size": 25600, "num_attention_heads": 64,
                  "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 64,
                  "vocab_size": 151936, "rope_theta": 1000000.0,
                  "max_position_embeddings": 40960},
    "Qwen3-30B-A3B": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                      "hidden_size": 2048, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_attention_heads": 32,
                      "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 48,
                      "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
                      "vocab_size": 151936, "max_position_embeddings": 40960},
    "Llama-3.1-8B": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                     "hidden_size": 4096, "intermediate_size": 14336,
                     "num_attention_heads": 32, "num_key_value_heads": 8,
                     "num_hidden_layers": 32, "vocab_size": 128256, "rope_theta": 500000.0,
                     "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192},
                     "max_position_embeddings": 131072},
}


def footprint(raw: dict[str, Any], page_size: int) -> dict[str, Any]:
    """One model's layers and, per length, (this worker's bytes, full-KV bytes)."""
    import torch

    from decode_worker.core.validation import min_swa_pages_per_request
    from decode_worker.device.kv_pool import KVSpec
    from decode_worker.device.model.registry import family_of
    from decode_worker.utils.mathx import cdiv

    cfg = family_of(raw, "config").read_config(raw, "config")
    spec = KVSpec.from_config(cfg)
    full_page = spec.page_bytes(page_size, torch.bfloat16, "full")
    swa_page = spec.page_bytes(page_size, torch.bfloat16, "swa")
    tail = min_swa_pages_per_request(cfg.window, page_size) if spec.num_swa_layers else 0
    out: dict[str, Any] = {"full": spec.num_full_layers, "swa": spec.num_swa_layers,
                           "window": cfg.window, "per_token": full_page // page_size}
    for n in LENGTHS:
        pages = cdiv(n, page_size)
        ours = spec.num_full_layers * pages * full_page \
            + spec.num_swa_layers * min(pages, tail) * swa_page
        everything = spec.num_full_layers * pages * full_page \
            + spec.num_swa_layers * pages * swa_page
        out[n] = (ours, everything)
    return out


def _gib(n: float) -> str:
    return f"{n / GIB:7.2f}"


def report(page_size: int, budget_gib: float) -> str:
    budget = budget_gib * GIB
    head = (f"{'model':<14} {'layers full/swa':>15} {'window':>6} {'B/tok/layer':>11} "
            + " ".join(f"{f'{n // 1024}k GiB this/all':>20}" for n in LENGTHS)
            + f" {'32k reqs in ' + str(int(budget_gib)) + ' GiB this/all':>28} {'x':>5}")
    lines = [head, "-" * len(head)]
    for name, raw in MODELS.items():
        f = footprint(raw, page_size)
        cells = " ".join(f"{_gib(f[n][0])} / {_gib(f[n][1])}  " for n in LENGTHS)
        ours, every = f[32768]
        fit_ours, fit_all = int(budget // ours), int(budget // every)
        split = f"{f['full']}/{f['swa']}"
        lines.append(f"{name:<14} {split:>15} {f['window']:>6} "
                     f"{f['per_token']:>11} {cells}{fit_ours:>16} / {fit_all:<9} "
                     f"{every / ours:5.1f}")
    lines.append(f"bf16 KV, page {page_size}; 'this': sliding layers keep window + margin "
                 "(their SWA tail), 'all': full KV in every layer (SGLang's layout for Gemma 3)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--page-size", type=int, default=16, help="tokens per KV page (16)")
    ap.add_argument("--budget-gib", type=float, default=40.0,
                    help="KV memory for the 'requests that fit' column (40 GiB)")
    args = ap.parse_args(argv)
    print(report(args.page_size, args.budget_gib))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
