#!/usr/bin/env python3
"""Wheels the GPU device image lacks, downloaded here for it (`bash scripts/gpu_wheels.sh`).

The device image (docs/GPU.md, "Target device image": Python 3.12, torch 2.11 + CUDA 13,
triton 3.6) has none of our pure-Python dependencies. This downloads them as cp312 manylinux
wheels into `.whl/` (ignored by git; carried to the device machine with the working tree, whose
whole load must stay under 64 MiB) and trims nixl's CUDA 13 wheel to what its UCX backend needs:
the bindings, `libplugin_UCX.so`, UCX with its CUDA and shared-memory transports, and the shared
libraries those load (found from their ELF `NEEDED` entries with `readelf`). Left out: the
expert-parallel module `nixl_ep_cu13/`, every other plugin (object stores, GDS, libfabric,
telemetry), the RDMA transports (one machine: loopback and CUDA IPC only), headers and tools.
`scripts/gpu_check.sh` unpacks `.whl/*.whl` there (`python3 -m zipfile -e`).

    python scripts/gpu_wheels.py [--dest .whl]
    python scripts/gpu_wheels.py --python-version 3.11 --only nixl-cu13==1.5.1 --dest /tmp/w
        # the same trim for this machine's Python: check it with the NIXL tests here
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# what the device image lacks (docs/GPU.md, "Target device image"), at the versions we run
WHEELS = ["pydantic==2.13.4", "pydantic-core==2.46.4", "pydantic-settings==2.14.1",
          "python-dotenv==1.2.2", "typing-inspection==0.4.2", "annotated-types==0.7.0",
          "typing-extensions==4.16.0", "msgspec==0.23.0", "pyzmq==27.3.0", "uvicorn==0.55.0",
          "httptools==0.9.0", "nixl==1.5.1", "nixl-cu13==1.5.1", "xgrammar==0.2.9",
          "apache-tvm-ffi==0.1.15.post2"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "any"]
# nixl-cu13: members kept outright (then every shared library they need)
UCX_ROOTS = re.compile(r"(^nixl_cu13/.*\.(py|typed|so)$|/libplugin_UCX\.so$"
                       r"|/ucx/lib(uct_cuda|ucm_cuda|uct_cma)\.so[.0-9]*$)")
DROP = re.compile(r"^(nixl_ep_cu13/|nixl_cu13\.scripts/|nixl_cu13-[^/]*\.data/)")


def download(dest: Path, py: str, wheels: list[str]) -> None:
    abi = "cp" + py.replace(".", "")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", py, "--implementation", "cp", "--abi", abi, "--abi",
           "abi3", "--abi", "none", "-d", str(dest)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run([*cmd, *wheels], check=True)


def needed(so: Path) -> list[str]:
    """The ELF NEEDED entries of `so` (readelf -d)."""
    out = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True,
                         check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def ucx_closure(tree: Path) -> set[str]:
    """Members (relative paths) of the unpacked nixl-cu13 wheel that its UCX backend uses."""
    files = [p for p in tree.rglob("*") if p.is_file()]
    by_name: dict[str, list[Path]] = {}
    for p in files:
        by_name.setdefault(p.name, []).append(p)
    keep = {p for p in files if UCX_ROOTS.search(p.relative_to(tree).as_posix())}
    todo = [p for p in keep if ".so" in p.name]
    while todo:
        for name in needed(todo.pop()):
            for dep in by_name.get(name, []):
                if dep not in keep:
                    keep.add(dep)
                    todo.append(dep)
    rels = {p.relative_to(tree).as_posix() for p in keep}
    rels |= {p.relative_to(tree).as_posix() for p in files if ".dist-info/" in p.as_posix()}
    return {r for r in rels if not DROP.search(r)}


def trim(wheel: Path) -> None:
    """Rewrite `wheel` with only its UCX members (the RECORD no longer matches: it is unpacked
    onto PYTHONPATH, never pip-installed)."""
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(tmp)
            members = zf.namelist()
        keep = ucx_closure(Path(tmp))
        slim = wheel.with_suffix(".slim")
        with zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as out:
            for name in members:
                if name in keep:
                    out.write(Path(tmp) / name, name)
    before = wheel.stat().st_size
    slim.replace(wheel)
    print(f"trimmed {wheel.name}: {before / 2**20:.1f} -> {wheel.stat().st_size / 2**20:.1f} MiB")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dest", type=Path, default=ROOT / ".whl")
    p.add_argument("--python-version", default="3.12", help="the device image's Python")
    p.add_argument("--only", nargs="*", help="just these of the wheels (e.g. nixl-cu13==1.5.1)")
    args = p.parse_args()
    args.dest.mkdir(parents=True, exist_ok=True)
    download(args.dest, args.python_version, args.only or WHEELS)
    for wheel in args.dest.glob("nixl_cu13-*.whl"):
        if wheel.stat().st_size > 30 * 2**20:  # not trimmed yet
            trim(wheel)
    total = sum(w.stat().st_size for w in args.dest.glob("*.whl"))
    print(f"gpu_wheels: {len(list(args.dest.glob('*.whl')))} wheels, "
          f"{total / 2**20:.1f} MiB in {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
