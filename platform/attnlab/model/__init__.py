"""The GPT model with RoPE + NTK scaling, any attention variant, presets, and compiling it (no Ray here)."""

from attnlab.model.compile import compile_enabled, compile_model, is_compiled
from attnlab.model.config import GPT2_VOCAB, PRESETS, GPTConfig, preset
from attnlab.model.gpt import GPT
from attnlab.model.rope import ROPE_SCALINGS, ntk_base

__all__ = ["GPT", "GPTConfig", "GPT2_VOCAB", "PRESETS", "ROPE_SCALINGS", "ntk_base", "preset", "compile_enabled",
           "compile_model", "is_compiled"]
