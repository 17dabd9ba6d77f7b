"""Compile the decode attention kernels for an H200 (sm_90) without a GPU: Triton's frontend,
its NVIDIA passes and the bundled ptxas, so a shape or type rule the interpreter does not check
(tl.dot operand shapes, constexpr branches, layouts) fails in CI here.

Run as `python -m tests.unit.device.sm90_compile` with TRITON_INTERPRET unset (under the
interpreter `@triton.jit` functions cannot be compiled). Prints one line per kernel.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from decode_worker.device.kernels import decode_attention as kernels

SM90 = GPUTarget("cuda", 90, 32)


def _compile(fn: object, sig: dict[str, str], consts: Mapping[str, object], warps: int) -> None:
    sig = {**sig, **dict.fromkeys(consts, "constexpr")}
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=SM90,
                              options={"num_warps": warps})
    assert "cubin" in compiled.asm, "no cubin"
    print(f"sm_90 {fn.__name__} {consts}: {compiled.metadata.shared} B shared")


def compile_all(dt: str, group: int, kv_heads: int, head_dim: int, page: int) -> None:
    """Stage 1, stage 2 and the KV write for pools and q of Triton dtype `dt`, with the
    compile-time parameters `paged_decode` and `write_kv` launch them with."""
    ints = dict.fromkeys(("s_page", "s_kv", "s_tok", "s_table", "ring"), "i32")
    _compile(kernels._stage1_kernel, {
        "q_ptr": f"*{dt}", "kv_ptr": f"*{dt}", "table_ptr": "*i32", "pos_ptr": "*i64",
        "part_ptr": "*fp32", "lse_ptr": "*fp32", "sq_b": "i32", "sq_h": "i32", **ints,
        "window": "i32", "scale": "fp32"},
        kernels.stage1_meta(group, head_dim, page, f32=dt == "fp32"), 4)
    _compile(kernels._stage2_kernel, {
        "part_ptr": "*fp32", "lse_ptr": "*fp32", "sink_ptr": "*fp32", "out_ptr": f"*{dt}",
        "so_b": "i32", "num_splits": "i32"}, kernels.stage2_meta(group, head_dim), 2)
    _compile(kernels._write_kv_kernel, {
        "k_ptr": f"*{dt}", "v_ptr": f"*{dt}", "kv_ptr": f"*{dt}", "table_ptr": "*i64",
        "pos_ptr": "*i64", "sk_b": "i32", "sk_h": "i32", "sv_b": "i32", "sv_h": "i32", **ints},
        kernels.write_meta(kv_heads, head_dim, page), 4)


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET to compile", file=sys.stderr)
        return 2
    compile_all("bf16", group=8, kv_heads=8, head_dim=64, page=64)  # gpt-oss
    compile_all("fp32", group=8, kv_heads=8, head_dim=64, page=64)
    compile_all("fp32", group=2, kv_heads=2, head_dim=16, page=16)  # the tiny model
    compile_all("bf16", group=8, kv_heads=8, head_dim=128, page=64)  # Qwen3-32B, Llama 3
    compile_all("bf16", group=2, kv_heads=16, head_dim=128, page=64)  # Gemma-3-27B
    compile_all("bf16", group=2, kv_heads=4, head_dim=256, page=64)  # Gemma 3 4B / 12B
    print(f"compiled for sm_90 with triton {triton.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
