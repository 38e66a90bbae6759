"""The Triton kernels compiled for a GPU on a machine without one: a static profile.

The figures and what they predict: docs/gpu.md#the-kernels-without-a-gpu.

For each variant the kernels compute and each architecture, every kernel of the forward and the backward is
compiled by Triton and the ptxas its wheel carries (``attnlab.attention.kernels.aot``), at GPT-2's head dimension in
bf16, with the block sizes a GPU node uses; the table gives registers per thread, spilled bytes, shared memory, and
the SASS of the loop over unmasked tiles per score element (all instructions; MUFU, the special-function unit's
transcendentals; FMUL). Static counts: both sides of a branch count, so they bound one iteration from above. Times
need a GPU: ``bench/gpu.py --quick`` part c.

    python bench/kernel_profile.py                       # lssar, lssa, softmax p=15 on sm_90 and sm_80
    python bench/kernel_profile.py --variants lssar --archs 90
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # bench/machine.py, also when a test loads this file
import machine  # noqa: E402  (puts platform/ on sys.path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="lssar,lssa,softmax:15", help="NAME or NAME:P, comma-separated")
    ap.add_argument("--archs", default="90,80", help="compute capabilities x 10, comma-separated (90: H100/H200)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("kernel_profile compiles for a GPU: run it without TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    from attnlab.attention import get_variant
    from attnlab.attention.kernels import aot

    machine.print_header(packages=("triton",))
    print("- bf16, head dim 64, the block sizes of attention/kernels/ops.py: GPU_BLOCKS\n")
    print("| variant | arch | kernel | registers x threads | spilled B | shared KiB | instructions / element | "
          "MUFU / element | FMUL / element |")
    print("|---|---|---|---|---|---|---|---|---|")
    for item in args.variants.split(","):
        name, _, p = item.partition(":")
        spec = get_variant(name, **({"p": float(p)} if p else {}))
        label = name if spec.p is None else f"{name} p={spec.p:g}"
        for arch in (int(a) for a in args.archs.split(",")):
            for b in aot.build_form(aot.form_of(spec), arch=arch):
                per = b.per_element
                loop = ("-" if not per else f"{per['total']:.1f}", f"{per.get('MUFU', 0):.1f}",
                        f"{per.get('FMUL', 0):.1f}")
                print(f"| {label} | sm_{arch} | {b.kernel} | {b.registers} x {b.warps * 32} | {b.spill_bytes} | "
                      f"{b.shared_bytes / 1024:.0f} | {' | '.join(loop)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
