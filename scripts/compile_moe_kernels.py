#!/usr/bin/env python3
"""Compile the fused MoE's Triton kernels for Hopper (sm_90) without a GPU; report their cost.

The interpreter (CPU tests) checks arithmetic, not whether a kernel compiles for the device (a
tile shape can crash a compiler pass, spill registers or overflow shared memory). This script
records the exact launches `fused_moe` makes at gpt-oss-20b's expert shape (hidden =
intermediate = 2880, 32 experts, top-4) for decode and prefill sizes, and Qwen3-30B-A3B's
plain SiLU-gated bf16 experts (hidden 2048, intermediate 768, 128 experts, top-8; decode and a
256-token step), with meta tensors, and
compiles each with the installed triton's bundled ptxas for sm_90. Per launch: shared memory,
registers, spilled bytes (cuobjdump -res-usage). Exit status 1 when a kernel fails to compile.

    python scripts/compile_moe_kernels.py [--tokens 1,64,256,4096]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)  # real JIT functions, before triton is imported

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python scripts/...` too

from decode_worker.device.kernels import fused_moe, moe_align

TARGET = GPUTarget("cuda", 90, 32)
_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
          torch.uint8: "u8", torch.int32: "i32", torch.int64: "i64"}


class Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kwargs)` records the launch."""

    def __init__(self, fn: Any, launches: list[tuple[Any, tuple[Any, ...], dict[str, Any]]]):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kwargs: self.launches.append((self.fn, args, kwargs))


def record(num_tokens: int, mxfp4: bool, dtype: torch.dtype, qwen3: bool = False) -> list[Any]:
    """The launches of one fused_moe call at the 20b expert shape (`qwen3`: Qwen3-30B-A3B's
    SiLU experts) with meta tensors: nothing runs."""
    launches: list[Any] = []
    saved = {m: {n: getattr(m, n) for n in names} for m, names in (
        (fused_moe, ("gate_up_kernel", "down_kernel", "sum_kernel")),
        (moe_align, ("_route_align_kernel",)))}
    for module, kernels in saved.items():
        for name, fn in kernels.items():
            setattr(module, name, Recorder(fn, launches))
    try:
        if qwen3:
            fused_moe.fused_moe(*_meta_inputs(num_tokens, False, dtype, (128, 2048, 768)), 8,
                                1.0, 0.0, silu=True)
        else:
            fused_moe.fused_moe(*_meta_inputs(num_tokens, mxfp4, dtype), 4, 1.702, 7.0)
    finally:
        for module, kernels in saved.items():
            for name, fn in kernels.items():
                setattr(module, name, fn)
    return launches


def _meta_inputs(num_tokens: int, mxfp4: bool, dtype: torch.dtype,
                 shape: tuple[int, int, int] = (32, 2880, 2880)) -> tuple[Any, ...]:
    (e, h, i), meta = shape, torch.device("meta")

    def t(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dt, device=meta)

    u8 = torch.uint8
    w = argparse.Namespace(
        gate_up=t(e, 2 * i, h // 2, dt=u8) if mxfp4 else t(e, h, 2 * i),
        gate_up_scales=t(e, 2 * i, h // 32, dt=u8) if mxfp4 else None,
        down=t(e, h, i // 2, dt=u8) if mxfp4 else t(e, i, h),
        down_scales=t(e, h, i // 32, dt=u8) if mxfp4 else None,
        gate_up_b=t(e, 2 * i), down_b=t(e, h))
    return t(num_tokens, h), t(num_tokens, e), w


def compile_launch(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Compile one recorded launch as the runtime would specialise it (16-aligned pointers,
    integers divisible by 16 marked so)."""
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    consts = {k: v for k, v in kwargs.items() if k not in options}
    signature, attrs = {}, {}
    runtime = iter(args)
    for idx, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            continue
        value = next(runtime)
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
            attrs[(idx,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32" if abs(int(value)) < 2 ** 31 else "i64"
            if int(value) % 16 == 0:
                attrs[(idx,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, signature, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=TARGET, options=options)


def resources(kernel: Any) -> str:
    """'regs R, spill S B, shared M B' of a compiled kernel."""
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([str(bin_dir / "cuobjdump"), "-res-usage", f.name],
                             capture_output=True, text=True, check=False).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    regs, stack = (m.group(1), m.group(2)) if m else ("?", "?")
    return f"regs {regs}, spill {stack} B, shared {kernel.metadata.shared} B"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="1,64,256,4096")
    args = p.parse_args()
    print(f"triton {triton.__version__}, target sm_{TARGET.arch}")
    failed = 0
    cases = [(int(n), True, torch.bfloat16, False) for n in args.tokens.split(",")]
    cases.append((4, False, torch.float32, False))  # dense float32 (the float32 e2e test)
    cases += [(1, False, torch.bfloat16, True), (256, False, torch.bfloat16, True)]  # Qwen3-MoE
    for num_tokens, mxfp4, dtype, qwen3 in cases:
        for fn, launch_args, kwargs in record(num_tokens, mxfp4, dtype, qwen3):
            tiles = {k: v for k, v in kwargs.items() if k in ("BM", "BN", "BK", "num_warps")}
            kind = "qwen3-silu" if qwen3 else "mxfp4" if mxfp4 else "dense"
            label = f"T={num_tokens} {kind} {dtype} {fn.__name__} {tiles}"
            try:
                print(f"{label}: {resources(compile_launch(fn, launch_args, kwargs))}", flush=True)
            except Exception as exc:  # a compiler failure is what this script reports
                failed += 1
                print(f"{label}: FAILED {type(exc).__name__}: {str(exc)[-300:]}", flush=True)
    print(f"compile_moe_kernels: {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
