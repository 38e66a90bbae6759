"""The GPU check of ``bench/gpu.py``, as parts sharing one harness (:mod:`gpucheck.harness`).

- the quick check (:mod:`gpucheck.quick`; ``python bench/gpu.py --quick``, ``make gpu-check``): six parts, none
  started after 6 minutes, with the site's torch and no Ray: environment, agreement, kernels, training, evaluation,
  checkpoint;
- the full run (:mod:`gpucheck.full`; ``make bench-gpu``): the parts of :data:`gpucheck.sizes.PARTS`, pytest's
  CUDA tests among them, meant to take under 25 minutes.

Each module holds one part (or the pieces two parts share) and stays under 300 lines.
"""
