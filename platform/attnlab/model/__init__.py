"""The GPT model with RoPE (and its NTK / PI / YaRN scalings at evaluation), any attention variant, presets, and compiling it; the same GPT over
(x, y) coordinate tokens (``OrbitGPT``), ``build_model`` / ``config_from_dict`` that pick one from a config, and
the per-GPU memory plan of a training step or an evaluation (``estimate_train_step`` ...; no Ray here)."""

from attnlab.model.compile import compile_enabled, compile_model, is_compile_failure, is_compiled, uncompile_model
from attnlab.model.config import GPT2_VOCAB, PRESETS, GPTConfig, preset
from attnlab.model.gpt import GPT
from attnlab.model.memory import (MemoryEstimate, estimate_eval, estimate_train_step, largest_eval_batch,
                                  largest_micro_batch)
from attnlab.model.orbit import MODEL_KINDS, OrbitGPT, OrbitGPTConfig, build_model, config_from_dict, with_kind
from attnlab.model.rope import ROPE_SCALINGS, ntk_base, rope_frequencies

__all__ = ["GPT", "GPTConfig", "GPT2_VOCAB", "PRESETS", "ROPE_SCALINGS", "ntk_base", "rope_frequencies", "preset", "compile_enabled",
           "compile_model", "is_compile_failure", "is_compiled", "uncompile_model", "MODEL_KINDS", "OrbitGPT",
           "OrbitGPTConfig", "build_model", "config_from_dict",
           "with_kind", "MemoryEstimate", "estimate_eval", "estimate_train_step", "largest_eval_batch",
           "largest_micro_batch"]
