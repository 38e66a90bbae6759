"""What an exported folder holds besides the tokenizer and the card: ``config.json``, ``generation_config.json``,
``model.safetensors`` and the modeling code, from a checkpoint's recorded configs and weights.

The modeling code is four files of this package's ``templates/`` folder (real Python, read as package data),
written as they are: ``configuration_attnlab.py``, ``modeling_attnlab.py``, ``attention_attnlab.py`` (the variants'
math, RoPE, ALiBi) and ``plugin_attnlab.py`` (a plugin variant's source run without attnlab), whose math is attnlab's
own code, copied (:mod:`attnlab.export.copies` checks it). ``config.json`` names them in ``auto_map`` and carries
the model's fields: attnlab's ``GPTConfig`` and its attention variant resolved to the fields of ``AttentionSpec`` (or
a plugin variant's name and recorded source, with its sha256).

Weights keep attnlab's names below ``model.`` (``model.blocks.0.attn.c_attn.weight``, ...); the LM head is tied to
the embedding and not stored. Imports the model and attention packages (the config) and safetensors; no transformers.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import importlib.util
import json

import torch

from attnlab.attention.spec import AttentionSpec, PluginSpec
from attnlab.errors import UserError
from attnlab.model.config import GPTConfig

TEMPLATES = ("configuration_attnlab.py", "modeling_attnlab.py", "attention_attnlab.py", "plugin_attnlab.py")
AUTO_MAP = {"AutoConfig": "configuration_attnlab.AttnlabConfig",
            "AutoModel": "modeling_attnlab.AttnlabModel",
            "AutoModelForCausalLM": "modeling_attnlab.AttnlabForCausalLM"}
# The transformers release the exported code is tested with (pyproject's hf extra floor), recorded in the config.
TRANSFORMERS_VERSION = "5.24.0"
# AttentionSpec fields that describe the math (name and source are labels; p is the config's p_eval).
_SPEC_LABELS = ("source", "p")


def template_bytes(name: str) -> bytes:
    """One modeling file as shipped in this package."""
    return importlib.resources.files("attnlab.export").joinpath("templates", name).read_bytes()


def attention_fields(spec: AttentionSpec | PluginSpec) -> dict:
    """The variant as config.json's ``attention``: every AttentionSpec field but its labels, or a plugin variant's
    name and position bias (its forms are its code)."""
    if isinstance(spec, PluginSpec):
        return {"name": spec.name, "position_bias": spec.position_bias}
    return {k: v for k, v in dataclasses.asdict(spec).items() if k not in _SPEC_LABELS}


def hf_config(cfg: GPTConfig, *, eot_id: int, p_eval: float | None, rope_scaling: str,
              plugin: dict | None, record: dict) -> dict:
    """config.json: the model's fields (with a fine-tune's training-time RoPE scaling and ``original_len``), how it
    runs by default (``p_eval``, ``rope_scaling``), where it came from."""
    spec = cfg.attention_spec(p=None)
    return {
        "architectures": ["AttnlabForCausalLM"],
        "auto_map": dict(AUTO_MAP),
        "model_type": "attnlab",
        "dtype": "float32",
        "vocab_size": cfg.vocab_size, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd,
        "train_len": cfg.train_len, "rope_base": float(cfg.rope_base), "block": cfg.block, "position": cfg.position,
        "bias": bool(cfg.bias), "mlp_hidden": cfg.mlp_hidden,
        "attention": attention_fields(spec),
        "plugin": plugin,
        "p_eval": p_eval,
        "attnlab_rope_scaling": rope_scaling,  # config.rope_scaling (configuration_attnlab.py says why)
        # a context-extension stage: the scaling it was fine-tuned with from original_len to train_len
        "attnlab_trained_rope_scaling": cfg.rope_scaling, "attnlab_trained_rope_factor": cfg.rope_factor,
        "original_len": cfg.original_len,
        "tie_word_embeddings": True,
        "use_cache": False,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "attnlab": record,
        "transformers_version": TRANSFORMERS_VERSION,
    }


def generation_config(eot_id: int) -> dict:
    """generation_config.json: stop at the end-of-text token, no KV cache (modeling_attnlab.py says why)."""
    return {"bos_token_id": eot_id, "eos_token_id": eot_id, "pad_token_id": eot_id, "use_cache": False,
            "transformers_version": TRANSFORMERS_VERSION}


def hf_weights(state: dict) -> dict[str, torch.Tensor]:
    """The checkpoint's model state under transformers' names: ``model.`` + attnlab's name, the tied LM head left out
    (each tensor a contiguous float copy: safetensors stores no shared memory)."""
    out = {}
    for name, tensor in state.items():
        if name == "lm_head.weight":
            continue
        if not isinstance(tensor, torch.Tensor):
            raise UserError(f"checkpoint model state {name!r} is a {type(tensor).__name__}, not a tensor")
        out[f"model.{name}"] = tensor.detach().to("cpu").contiguous().clone()
    if "model.wte.weight" not in out:
        raise UserError("checkpoint model state has no wte.weight: not an attnlab GPT checkpoint")
    return out


def require_safetensors() -> None:
    """One line when the ``hf`` extra is missing (checked before anything is read or written)."""
    if importlib.util.find_spec("safetensors") is None:
        raise UserError("attnlab export needs safetensors, which is not installed: pip install 'attnlab[hf]'")


def safetensors_bytes(weights: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save(weights, metadata={"format": "pt"})


def json_bytes(payload: dict) -> bytes:
    return (json.dumps(payload, indent=2, sort_keys=False) + "\n").encode("utf-8")
