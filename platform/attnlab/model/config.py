"""The model configuration and its presets (docs/protocol.md#presets).

``GPTConfig`` is a small frozen dataclass; presets are plain functions of the data's vocabulary. The
``tiny`` presets keep head dim 64 (it enters LSSA's ln(d)) so CPU proxies stay faithful.
No Ray, no torch modules here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from attnlab.attention import Backend, get_variant
from attnlab.attention.kernels import unsupported_reason as kernels_unsupported_reason
from attnlab.attention.sdpa import sdpa_unsupported_reason
from attnlab.attention.spec import P_TRAIN_DEFAULT, AttentionSpec, PluginSpec, parse_p_train
from attnlab.errors import UserError
from attnlab.names import GPT2_VOCAB


# Position encodings (docs/protocol.md#position-encoding): rotary (the default), none at all (the causal mask
# only, "NoPE"), or ALiBi's linear bias on the attention scores (the attention backends add it: AttentionSpec).
POSITIONS = ("rope", "nope", "alibi")
# Blocks (docs/protocol.md#blocks): GPT-2's (LayerNorm, GELU MLP, biases) or Llama's (RMSNorm, SwiGLU, no biases).
BLOCKS = ("gpt2", "llama")


def alibi_override() -> dict | None:
    """The AttentionSpec field that turns on ALiBi's bias, as ``{field: value}``; None while the attention
    package has no such field (``position: alibi`` is then refused)."""
    fields = {f.name for f in dataclasses.fields(AttentionSpec)}
    if "alibi" in fields:
        return {"alibi": True}
    if "position_bias" in fields:
        return {"position_bias": "alibi"}
    return None


@dataclass(frozen=True)
class GPTConfig:
    """A GPT-2 style decoder with RoPE. ``attention``/``p_train``/``scale`` select the attention variant: a
    registered name, or the name of a variant from a loaded plugin (docs/plugins.md; it has no ``scale``).

    ``p_train``: ``"default"`` (the variant's own sharpening power: 15 for lssar, none for the others), None
    (no sharpening) or a number >= 1 (docs/attention.md#sharpening). ``position``: ``rope``, ``nope`` or
    ``alibi`` (:data:`POSITIONS`); ``block``: ``gpt2`` or ``llama`` (:data:`BLOCKS`; llama has no biases, so
    ``bias`` is False for it whatever was given).
    """

    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    vocab_size: int = GPT2_VOCAB
    train_len: int = 1024
    rope_base: float = 10000.0
    attention: str = "softmax"
    p_train: float | str | None = P_TRAIN_DEFAULT
    scale: str | float | None = None  # None: the variant's own scale
    bias: bool = True
    init_std: float = 0.02
    attn_impl: str = "auto"  # a Backend value: auto, dense, flex, sdpa, triton (stored as the string)
    position: str = "rope"  # rope | nope | alibi (POSITIONS)
    block: str = "gpt2"  # gpt2 | llama (BLOCKS)
    # A context-extension stage (docs/stages.md): the length its lineage was first trained at (None: train_len),
    # and the RoPE scaling it was fine-tuned with from there to train_len (attnlab.model.rope.TrainedScaling).
    original_len: int | None = None
    rope_scaling: str = "none"
    # its factor when the stage set one apart from train_len / original_len (None: that ratio)
    rope_factor: float | None = None

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "vocab_size", "train_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"model.{name}={value!r} is not allowed: use a positive integer")
        for name, allowed in (("position", POSITIONS), ("block", BLOCKS)):
            if getattr(self, name) not in allowed:
                raise UserError(f"model.{name}={getattr(self, name)!r} is not allowed: use one of {', '.join(allowed)}")
        if self.position == "alibi" and alibi_override() is None:
            raise UserError("model.position='alibi' needs ALiBi's bias in the attention backends "
                            "(AttentionSpec has no alibi field yet): use rope or nope")
        if self.block == "llama":
            object.__setattr__(self, "bias", False)
        self._check_extension()
        if self.n_embd % self.n_head:
            raise UserError(f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}")
        if self.head_dim % 2 and self.position == "rope":
            raise UserError(f"model head dim {self.head_dim} (n_embd/n_head) must be even for RoPE")
        try:
            object.__setattr__(self, "p_train", parse_p_train(self.p_train, "model.p_train"))
        except ValueError as exc:
            raise UserError(str(exc)) from None
        try:
            spec = self.attention_spec()
        except ValueError as exc:
            raise UserError(f"model attention: {exc}") from None
        self._check_attn_impl(spec)

    def _check_attn_impl(self, spec: AttentionSpec) -> None:
        try:
            impl = Backend.parse(self.attn_impl, field="model.attn_impl")
        except ValueError as exc:
            raise UserError(str(exc)) from None
        object.__setattr__(self, "attn_impl", impl.value)
        if impl is Backend.SDPA and sdpa_unsupported_reason(spec) is not None:
            raise UserError(f"model.attn_impl='sdpa' cannot compute attention {spec.name!r} exactly: "
                            f"{sdpa_unsupported_reason(spec)}; use auto, flex or dense")
        if impl is Backend.TRITON and kernels_unsupported_reason(spec) is not None:
            raise UserError(f"model.attn_impl='triton' cannot compute attention {spec.name!r}: "
                            f"{kernels_unsupported_reason(spec)}; use auto, flex or dense")

    def _check_extension(self) -> None:
        from attnlab.names import parse_rope

        if self.original_len is not None and (isinstance(self.original_len, bool) or not isinstance(
                self.original_len, int) or not 1 <= self.original_len <= self.train_len):
            raise UserError(f"model.original_len={self.original_len!r} is not allowed: use the length the run's "
                            f"lineage was first trained at, a positive integer up to train_len={self.train_len}")
        rope = parse_rope({"method": self.rope_scaling, "factor": self.rope_factor})
        object.__setattr__(self, "rope_factor", rope.factor)
        if self.rope_scaling != "none":
            if self.position != "rope":
                raise UserError(f"rope_scaling={self.rope_scaling!r} in training needs RoPE: this model's position "
                                f"is {self.position} (no rotation to scale); use rope_scaling: none")
            if self.original_len is None or self.original_len >= self.train_len:
                raise UserError(f"rope_scaling={self.rope_scaling!r} in training scales from a shorter original "
                                f"length to seq_len={self.train_len}: it needs a parent trained at a shorter length "
                                "(a stage's from:)")

    @property
    def base_len(self) -> int:
        """The length evaluation multiples count from: the lineage's first training length (train_len for a run
        trained once)."""
        return self.original_len or self.train_len

    @property
    def trained_scaling(self):
        """The RoPE scaling the model was fine-tuned with (:class:`attnlab.model.rope.TrainedScaling`), None when
        it was not."""
        if self.rope_scaling == "none" or self.original_len is None:
            return None
        from attnlab.model.rope import TrainedScaling

        return TrainedScaling(self.rope_scaling, self.original_len, self.rope_factor)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def attention_spec(self, p: float | None | str = "train") -> AttentionSpec | PluginSpec:
        """The training-time spec (``p="train"``), or the same variant with sharpening power ``p`` (None:
        no sharpening; ``"default"``: the variant's own); a :class:`PluginSpec` for a plugin's variant."""
        overrides = {}
        if self.scale is not None:
            overrides["scale"] = self.scale
        if p == "train":
            p = self.p_train
        if p != P_TRAIN_DEFAULT:
            overrides["p"] = p
        spec = get_variant(self.attention, **overrides)
        if self.position == "alibi":
            spec = dataclasses.replace(spec, **alibi_override())
        return spec

    @property
    def mlp_hidden(self) -> int:
        """The MLP's hidden width: 4 x n_embd (gpt2), or Llama's SwiGLU 8/3 x n_embd rounded up to a multiple
        of 64 (llama; Touvron et al. 2023 round to 256 at their sizes)."""
        if self.block == "llama":
            return 64 * math.ceil(8 * self.n_embd / 3 / 64)
        return 4 * self.n_embd

    def replace(self, **changes) -> "GPTConfig":
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, dict] = {
    # GPT-2 small as in llm.c, with RoPE instead of the learned position table: 124M less 0.8M.
    "gpt2-small": dict(n_layer=12, n_head=12, n_embd=768, train_len=1024),
    # GPT-2 medium: 355M (less the 1.0M position table).
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, train_len=1024),
    # The paper's smallest size, ~45M: 6 layers x 512 wide, 8 heads of 64.
    "gpt2-45m": dict(n_layer=6, n_head=8, n_embd=512, train_len=1024),
    # CPU proxies: head dim 64; trains at 64 tokens, evaluates to 16x = 1024 on a laptop.
    "tiny": dict(n_layer=2, n_head=2, n_embd=128, train_len=64),
    "tiny-4l": dict(n_layer=4, n_head=4, n_embd=256, train_len=128),
    # The same sizes with the Llama block (RMSNorm, SwiGLU of 8/3 x width rounded to 64, no biases):
    # docs/protocol.md#presets.
    "llama-45m": dict(n_layer=6, n_head=8, n_embd=512, train_len=1024, block="llama"),
    "tiny-llama": dict(n_layer=2, n_head=2, n_embd=128, train_len=64, block="llama"),
}


def preset(name: str, **overrides) -> GPTConfig:
    """A preset config with fields overridden (e.g. ``vocab_size`` from the data, ``attention``, ``p_train``)."""
    if name not in PRESETS:
        raise UserError(f"preset={name!r} is unknown: use one of {', '.join(sorted(PRESETS))}")
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise UserError(f"model.{unknown[0]} is not a model field: use one of {', '.join(sorted(fields))}")
    return GPTConfig(**{**PRESETS[name], **overrides})

