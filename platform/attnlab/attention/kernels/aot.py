"""The kernels compiled for a CUDA architecture on a machine without a GPU, and what the compiler made of them.

Triton's compiler and the ``ptxas`` its wheel carries build the cubin a GPU node builds, for the block sizes of
``ops.GPU_BLOCKS``, from the launches the operators make (``ops.forward_launches`` / ``backward_launches`` on meta
tensors, with Triton's own specialisation of the arguments: a pointer or an integer divisible by 16, an integer equal
to 1). A kernel that does not compile for ``sm_90`` fails here on CPU; its registers, spilled bytes and shared memory
are read off the binary, and its SASS counted: ``MUFU`` (the special-function unit: exp2, log2, reciprocals), the
tensor-core instructions and the rest. That is a static profile (docs/gpu.md#the-kernels-without-a-gpu); only a GPU
gives times. ``python -m attnlab.attention.kernels.aot --variant lssar --arch 90`` prints a line per kernel
(``--json``: the figures); it must run in a process without Triton's interpreter (the test suite's has it: its test
runs this in a subprocess). Used by ``tests/test_attention_triton.py`` (cuda_proxy) and ``bench/kernel_profile.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import attnlab.attention.kernels.ops as ops

TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


@dataclass
class Build:
    """One kernel's cubin: registers per thread, spilled bytes per thread (local memory), shared memory per block,
    compile seconds, and the SASS of its loop over tiles without a mask (the one that runs for all but the diagonal
    tiles), per score element a thread handles: instructions in all, and by opcode family (``MUFU``, ``FMUL``, ...).
    Static counts: both sides of a branch are counted (the integer and the real power, say), so they bound what
    one iteration executes from above."""

    kernel: str
    warps: int
    registers: int
    spill_bytes: int
    shared_bytes: int
    seconds: float
    per_element: dict[str, float] = field(default_factory=dict)

    def line(self) -> str:
        top = sorted(((n, op) for op, n in self.per_element.items() if op != "total"), reverse=True)[:4]
        families = ", ".join(f"{op} {n:.1f}" for n, op in top)
        return (f"{self.kernel}: {self.registers} registers x {self.warps * 32} threads, {self.spill_bytes} B spilled, "
                f"{self.shared_bytes / 1024:.0f} KiB shared; loop: {self.per_element.get('total', 0):.1f} instructions "
                f"per score element ({families}); compiled in {self.seconds:.1f} s")


def loops(sass: str) -> list[list[str]]:
    """The opcodes of each loop of a SASS listing (from a backward branch's target to the branch)."""
    instruction = r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)[^;\n]*;"
    branch = r"/\*([0-9a-f]{4,})\*/[^;\n]*\bBRA\b[^;\n]*?(0x[0-9a-f]+)"
    lines = [(int(a, 16), op) for a, op in re.findall(instruction, sass)]
    targets = [(int(a, 16), int(t, 16)) for a, t in re.findall(branch, sass)]
    return [[op for a, op in lines if target <= a <= branch] for branch, target in targets if target < branch]


def _signature(launch: ops.Launch):
    kernel = launch.kernel
    if not isinstance(kernel, triton.runtime.JITFunction):
        raise RuntimeError("Triton's interpreter is on in this process (TRITON_INTERPRET=1 when Triton was imported): "
                           "its language is interpreted too, so nothing can be compiled here; run "
                           "python -m attnlab.attention.kernels.aot in a process without it")
    names = kernel.arg_names
    constexprs = dict(launch.constexprs)
    if "FAST" in constexprs:
        constexprs["FAST"] = True  # what a GPU runs, whichever twin this process launches
    bm, bn, warps, stages = ops.GPU_BLOCKS[launch.name]
    constexprs.update({"BM": bm} if not bn else {"BM": bm, "BN": bn})
    runtime = [n for n in names if n not in constexprs]
    signature, attrs = {}, {}
    for index, (name, value) in enumerate(zip(runtime, launch.args)):
        position = names.index(name)
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + TYPES[value.dtype]
            attrs[(position,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"argument {name} of {kernel.__name__}: {value!r}")
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1:
            signature[name] = "constexpr"
            constexprs[name] = 1
        else:
            signature[name] = "i32" if abs(value) < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(position,)] = [["tt.divisibility", 16]]
    for name in constexprs:
        signature[name] = "constexpr"
    return ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs), warps, stages


def _tool(name: str, *args: str) -> str:
    return subprocess.run([os.path.join(TOOLS, name), *args], capture_output=True, text=True, check=True).stdout


def compile_launch(launch: ops.Launch, arch: int = 90) -> Build:
    """Compile one launch for ``sm_{arch}`` and read its cubin."""
    source, warps, stages = _signature(launch)
    start = time.perf_counter()
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": warps, "num_stages": stages})
    seconds = time.perf_counter() - start
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = _tool("cuobjdump", "--dump-resource-usage", f.name)
        sass = _tool("cuobjdump", "-sass", f.name)
    figures = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", usage))
    per_element: dict[str, float] = {}
    bodies = loops(sass)
    if bodies:
        body = min(bodies, key=len)  # the loop without a mask: the diagonal's has the comparisons besides
        bm, bn, _, _ = ops.GPU_BLOCKS[launch.name]
        elements = bm * max(bn, 1) / (warps * 32)
        per_element["total"] = len(body) / elements
        for op in body:
            family = op.split(".")[0]
            per_element[family] = per_element.get(family, 0) + 1 / elements
    return Build(launch.kernel.__name__, warps, int(figures.get("REG", 0)),
                 int(figures.get("LOCAL", 0)) + int(figures.get("STACK", 0)), compiled.metadata.shared, seconds,
                 per_element)


def launches(form: ops.Form, dtype: torch.dtype = torch.bfloat16, head_dim: int = 64, seq_len: int = 4096,
             heads: int = 16, batch: int = 1, with_grad: bool = True) -> list[ops.Launch]:
    """The forward's launches (and the backward's, ``with_grad``) for ``form`` on meta tensors of this size."""
    meta = dict(device="meta", dtype=dtype)
    q, k, v = (torch.empty(batch, heads, seq_len, head_dim, **meta) for _ in range(3))
    p = torch.empty(1, device="meta", dtype=torch.float32)
    out = torch.empty_like(q)
    stats = torch.empty(5, batch * heads, seq_len, device="meta", dtype=torch.float32)
    u = torch.empty_like(q) if form.sharpen and with_grad else torch.empty(0, **meta)
    factors = torch.empty(2, batch * heads, seq_len, device="meta", dtype=torch.float32)
    plan = ops.forward_launches(q, k, v, p, form, factors, out, u, stats)
    if with_grad:
        rows = torch.empty(batch * heads, seq_len, device="meta", dtype=torch.float32)
        plan += ops.backward_launches(torch.empty_like(q), q, k, v, out, u, stats, p, form, factors, rows, rows,
                                      torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    return plan


def build_form(form: ops.Form, arch: int = 90, **sizes) -> list[Build]:
    """Every kernel of ``form`` (forward and backward) compiled for ``sm_{arch}``."""
    return [compile_launch(launch, arch) for launch in launches(form, **sizes)]


def form_of(spec) -> ops.Form:
    """The kernels' :class:`ops.Form` of an attention spec (``kernels.unsupported_reason(spec)`` must be None)."""
    from attnlab.attention.kernels import PHIS

    scale_mul, scale_log = ops.scale_form(spec.scale, spec.coef, 64)
    return ops.Form(PHIS[spec.phi], spec.qk_norm, scale_mul, scale_log, spec.p is not None)


def main(argv: list[str] | None = None) -> int:
    from attnlab.attention import get_variant

    ap = argparse.ArgumentParser(description="Compile the Triton kernels of a variant for a CUDA architecture, "
                                 "without a GPU, and print registers, spills, shared memory and SASS per element.")
    ap.add_argument("--variant", default="lssar", help="a variant the kernels compute (default lssar)")
    ap.add_argument("--p", type=float, default=None, help="sharpen with this power (default: the variant's)")
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10: 90 (H100/H200), 80 (A100)")
    ap.add_argument("--dtype", choices=tuple(str(t).removeprefix("torch.") for t in TYPES), default="bfloat16")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--json", action="store_true", help="one JSON object per kernel instead of a line")
    args = ap.parse_args(argv)
    spec = get_variant(args.variant, **({} if args.p is None else {"p": args.p}))
    form = form_of(spec)
    for build in build_form(form, arch=args.arch, dtype=getattr(torch, args.dtype), head_dim=args.head_dim):
        print(json.dumps(dataclasses.asdict(build)) if args.json else build.line(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
