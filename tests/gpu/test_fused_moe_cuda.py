"""The fused Triton MoE compiled on CUDA (needs CUDA; auto-skipped): the interpreter tests of
tests/unit/device/test_fused_moe.py run again here, then gpt-oss-20b's expert shape at decode
and prefill sizes, and decode steps captured in CUDA graphs with the Triton MoE.

Tolerances: float32 as in the unit tests (1e-5 relative: IEEE float32 products, only the
summation order differs); bfloat16 2 % of the float32 reference's largest magnitude (the kernel
rounds the SwiGLU output and the result to bf16).
"""

from __future__ import annotations

import pytest
import torch

from decode_worker.device.default_model import tiny_config
from decode_worker.device.kv_pool import KVPools, KVSpec
from decode_worker.device.model import gpt_oss
from decode_worker.device.model.config import GptOssConfig
from decode_worker.device.model.gpt_oss import GptOssModel
from decode_worker.device.model.synthetic import random_mxfp4_checkpoint
from decode_worker.device.model.weights import from_state_dict
from decode_worker.device.runner import ModelRunner
from tests.decode_steps import run_steps
from tests.unit.device.test_fused_moe import (  # the same tests, compiled here
    test_bfloat16_moe_is_as_close_to_float32_as_the_torch_path,
    test_dense_float32_experts_run_through_the_kernel,
    test_every_token_on_one_expert,
    test_kernel_tiles_decode_mxfp4_bit_for_bit,
    test_mxfp4_moe_matches_the_torch_moe_on_dequantized_weights,
    test_routing_sorts_every_pair_once_into_blocks_of_its_expert,
    test_the_clamp_and_the_biases_are_exercised,
    test_weights_in_neither_form_are_refused,
)

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
__all__ = [
    "test_bfloat16_moe_is_as_close_to_float32_as_the_torch_path",
    "test_dense_float32_experts_run_through_the_kernel", "test_every_token_on_one_expert",
    "test_kernel_tiles_decode_mxfp4_bit_for_bit",
    "test_mxfp4_moe_matches_the_torch_moe_on_dequantized_weights",
    "test_routing_sorts_every_pair_once_into_blocks_of_its_expert",
    "test_the_clamp_and_the_biases_are_exercised", "test_weights_in_neither_form_are_refused",
]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.fixture(scope="module")
def layer_20b() -> tuple[gpt_oss.LayerWeights, gpt_oss.LayerWeights, GptOssConfig]:
    """One layer of gpt-oss-20b's expert shape (hidden 2880 = 22.5 K tiles of 128: the masked
    tail runs), MXFP4 kept in bf16 and dequantized in float32."""
    cfg = GptOssConfig.from_dict(tiny_config(
        hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
        num_hidden_layers=1, num_attention_heads=64, num_key_value_heads=8, head_dim=64))
    state = random_mxfp4_checkpoint(cfg, CUDA, torch.bfloat16, seed=0)
    kept = from_state_dict(cfg, state, CUDA, torch.bfloat16, moe_backend="triton").layers[0]
    state32 = {n: t.float() if t.is_floating_point() else t for n, t in state.items()}
    dense = from_state_dict(cfg, state32, CUDA, torch.float32, moe_backend="torch").layers[0]
    return kept, dense, cfg


@pytest.mark.parametrize("num_tokens", [1, 8, 64, 256, 1000])
def test_20b_expert_shape_matches_the_torch_moe(
        layer_20b: tuple[gpt_oss.LayerWeights, gpt_oss.LayerWeights, GptOssConfig],
        num_tokens: int) -> None:
    kept, dense, cfg = layer_20b
    x = torch.randn(num_tokens, 2880, device=CUDA, generator=torch.Generator(CUDA).manual_seed(
        num_tokens)).bfloat16()
    out = gpt_oss.moe(x, kept, cfg, static=True, backend="triton")  # [T, H] bf16
    # the reference routes on the same bf16 logits (bf16 ties would otherwise be a coin toss)
    router = torch.nn.functional.linear(x, kept.router_w, kept.router_b)  # [T, E] bf16
    top_v, top_i = torch.topk(router.float(), cfg.num_experts_per_tok)
    ref = gpt_oss._moe_loop(x.float(), dense, cfg, top_i, torch.softmax(top_v, dim=-1))
    assert rel_err(out, ref) < 0.02


def model(dtype: torch.dtype, backend: str) -> GptOssModel:
    cfg = GptOssConfig.from_dict(tiny_config())
    state = random_mxfp4_checkpoint(cfg, CUDA, dtype, seed=1)
    return from_state_dict(cfg, state, CUDA, dtype, moe_backend=backend)


def runner(m: GptOssModel, graphs: bool) -> ModelRunner:
    pools = KVPools(KVSpec.from_config(m.cfg), 512, 512, 16, CUDA, m.dtype)
    return ModelRunner(m, pools, use_cuda_graph=graphs, graph_batch_sizes=[1, 2, 4, 8],
                       max_graph_pages=32)


@pytest.mark.parametrize("bs", [1, 3, 8])
def test_graph_captured_triton_moe_equals_the_torch_moe_in_float32(
        bs: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """MXFP4 kept (float32 activations) in CUDA graphs vs the dequantized torch model eager:
    token-exact, logits within 1e-4."""
    lengths = [5 + 37 * i for i in range(bs)]
    reference = run_steps(runner(model(torch.float32, "torch"), graphs=False), lengths, steps=4)

    def refuse(*_: object) -> torch.Tensor:
        raise AssertionError("the dense MoE ran")

    monkeypatch.setattr(gpt_oss, "_moe_dense", refuse)
    graphed = runner(model(torch.float32, "triton"), graphs=True)
    got = run_steps(graphed, lengths, steps=4)
    assert graphed.graphs is not None and graphed.graphs.graphs
    assert torch.equal(got.argmax(-1), reference.argmax(-1))
    assert (got - reference).abs().max().item() < 1e-4
    graphed.destroy()


def test_graph_replay_equals_eager_with_bf16_mxfp4() -> None:
    """One step (a later one could follow a token flipped by bf16 rounding): the bucket pads 3
    rows to 4, so GEMM tiles differ; 3 % of the largest logit."""
    m = model(torch.bfloat16, "triton")
    eager = run_steps(runner(m, graphs=False), [5, 42, 79], steps=1)
    graphed_runner = runner(m, graphs=True)
    graphed = run_steps(graphed_runner, [5, 42, 79], steps=1)
    assert graphed_runner.graphs is not None and graphed_runner.graphs.graphs
    assert rel_err(graphed, eager) < 0.03
    graphed_runner.destroy()
