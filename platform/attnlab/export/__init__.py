"""Export a trained run to a Hugging Face model folder (``attnlab export``, docs/export.md).

:func:`export_run` writes a checkpoint's weights, its configuration, its tokenizer and self-contained modeling code
into a folder that ``transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` loads with
no network and no attnlab, with attnlab's logits for every built-in variant, both blocks, RoPE/NoPE/ALiBi and plugin
variants. Modules: :mod:`.folder` (the checks, the staging and the commit), :mod:`.hf_format` (config.json, the
weights, the modeling files), :mod:`.tokenizer_files`, :mod:`.card` (README.md), ``templates/`` (the modeling
code written into the folder, package data: mostly attnlab's own code under ``# Copied from`` lines) and
:mod:`.copies` (checks those copies against their sources; ``--fix`` rewrites them). Below training and evaluation:
imports model, attention, data, location, runfolder and results only.
"""

from attnlab.export.folder import export_run

__all__ = ["export_run"]
