"""The configuration of a GPT trained with attnlab, as transformers' remote code written by ``attnlab export``
(``AutoConfig.from_pretrained(folder, trust_remote_code=True)``; attnlab itself is not needed).

It owns config.json's fields: attnlab's ``GPTConfig`` as the run trained it (sizes, ``block``, ``position``, the RoPE
base, ``train_len``; a fine-tune's ``trained_rope_scaling``, its factor and ``original_len``), the variant's resolved
``AttentionSpec`` fields (``attention``) or a plugin's recorded source (``plugin``), and the two fields that choose
how the model runs and may change after loading (``model.config.p_eval = 4``): ``p_eval``, the sharpening power, and
``rope_scaling``, attnlab's name of an evaluation-time scaling. attnlab's names of scalings are stored under
attnlab's prefix (``attnlab_rope_scaling``, ...; ``attribute_map`` reads and writes them as ``rope_scaling``, ...):
transformers reads a ``rope_scaling`` key as its own RoPE dictionary. A value the model cannot run with is one line
naming the field. It computes nothing of the model (modeling_attnlab.py).

Details: attnlab's docs/export.md#p_eval-and-rope_scaling.
"""

from __future__ import annotations

from transformers import PreTrainedConfig

from .attention_attnlab import ROPE_SCALINGS, check_scaling


class AttnlabConfig(PreTrainedConfig):
    model_type = "attnlab"
    attribute_map = {"hidden_size": "n_embd", "num_attention_heads": "n_head", "num_hidden_layers": "n_layer",
                     "max_position_embeddings": "train_len", "rope_scaling": "attnlab_rope_scaling",
                     "trained_rope_scaling": "attnlab_trained_rope_scaling",
                     "trained_rope_factor": "attnlab_trained_rope_factor"}

    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    train_len: int = 1024  # the training length (the model runs at any length; RoPE scalings apply beyond it)
    rope_base: float = 10000.0
    block: str = "gpt2"  # gpt2: LayerNorm + GELU MLP; llama: RMSNorm + SwiGLU, no biases
    position: str = "rope"  # rope | nope | alibi
    bias: bool = True
    mlp_hidden: int = 3072
    attention: dict | None = None  # the variant: attnlab AttentionSpec fields, or {"name": ...} of a plugin variant
    plugin: dict | None = None  # a plugin variant's source: origin, kind, entry, sha256, files {path: text}
    p_eval: float | None = None
    attnlab_rope_scaling: str = "none"  # config.rope_scaling (attribute_map)
    attnlab_trained_rope_scaling: str = "none"  # config.trained_rope_scaling: the fine-tune's scaling (docstring)
    attnlab_trained_rope_factor: float | None = None  # config.trained_rope_factor: its factor (None: the ratio)
    original_len: int | None = None  # the length the run's lineage was first trained at (None: train_len)
    attnlab: dict | None = None  # where the export came from (train key, checkpoint, step), for the record
    tie_word_embeddings: bool = True
    use_cache: bool = False  # no KV cache: each forward recomputes the whole sequence (modeling_attnlab.py)
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.validate_attnlab()

    def validate_attnlab(self) -> None:
        """One line naming the field and what is allowed, for a value the model cannot run with."""
        check_scaling(self.rope_scaling)
        if self.trained_rope_scaling not in ROPE_SCALINGS:
            raise ValueError(f"trained_rope_scaling={self.trained_rope_scaling!r} is not allowed: use one of "
                             f"{', '.join(ROPE_SCALINGS)}")
        f = self.trained_rope_factor
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not f >= 1):
            raise ValueError(f"trained_rope_factor={f!r} is not allowed: use None (train_len / original_len) or a "
                             "number >= 1")
        n = self.original_len
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.train_len):
            raise ValueError(f"original_len={n!r} is not allowed: use None or a positive integer up to "
                             f"train_len={self.train_len}")
        if self.trained_rope_scaling != "none" and (self.position != "rope" or n is None or n >= self.train_len):
            raise ValueError(f"trained_rope_scaling={self.trained_rope_scaling!r} is not allowed with position="
                             f"{self.position!r}, original_len={n!r}, train_len={self.train_len}: a training-time "
                             "scaling needs position rope and an original_len below train_len")
        p = self.p_eval
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not p >= 1):
            raise ValueError(f"p_eval={p!r} is not allowed: use None (no sharpening) or a number >= 1")
        for name, allowed in (("block", ("gpt2", "llama")), ("position", ("rope", "nope", "alibi"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not allowed: use one of {', '.join(allowed)}")


__all__ = ["AttnlabConfig"]
