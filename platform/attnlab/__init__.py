"""attnlab: a Ray platform for studying how attention mechanisms extrapolate in length.

Sub-packages, one per stage (the science ones import and test without Ray):
- ``attnlab.attention``: the attention variants of docs/attention.md (dense reference + fused FlexAttention path).
- ``attnlab.model``: GPT-2 with RoPE + NTK scaling, presets.
- ``attnlab.data``: tokeniser, sources, Arrow token shards, batch readers, synthetic probes.
- ``attnlab.train``: per-worker training loop and the Ray Train wiring.
- ``attnlab.evaluate``: extrapolation eval, passkey, attention diagnostics.
- ``attnlab.results``: the Parquet results store and reports.
- ``attnlab.study``: study spec, Tune + Optuna wiring.
"""

__version__ = "0.1.0"
