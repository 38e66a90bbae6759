"""A GPT trained with attnlab, as a transformers model (remote code written by ``attnlab export``):
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)``, with no network and no attnlab.

Read top to bottom, it is attnlab's model (attnlab/model/gpt.py): GPT-2's block (pre-LayerNorm with biases, tanh-GELU
MLP) or Llama's (pre-RMSNorm, SwiGLU, no biases), tied input/output embeddings, no position table; RoPE (with the
``rope_scaling`` chosen in the config, on top of the ``trained_rope_scaling`` of a run fine-tuned with one), NoPE or
ALiBi; the run's attention variant on attnlab's dense backend (``attention_attnlab.py``, sharpened with ``p_eval``;
or a plugin's own code, ``plugin_attnlab.py``). The norms, the MLPs and the sharpening power as a tensor are
attnlab's code under ``# Copied from`` lines; the transformers classes, the attention layer and the block are this
folder's (attnlab's carry its backends and diagnostics). Its logits are attnlab's.

Generation: ``model.generate`` works, with **no KV cache**: every step runs the whole sequence again, as the variants
need (the NTK base and PI/YaRN depend on the current length, ``sigmoid_ramapuram`` reads ``-ln T``, a row normalised
over the whole row is recomputed). An ``attention_mask`` may mark padding after a sequence (right padding), never
before it or inside it: positions are counted from the first token. Details: attnlab's docs/export.md.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput

from .attention_attnlab import AttentionSpec, PluginSpec, TrainedScaling, apply_rope, attend_dense, scaled_rope_tables
from .configuration_attnlab import AttnlabConfig
from .plugin_attnlab import Shape, attend_reference, build_params, load_variant, prepare_state

# Copied from attnlab.model.gpt.RMS_EPS
RMS_EPS = 1e-5

# Copied from attnlab.model.gpt.GRAPH_POWER
GRAPH_POWER = 1.0


# Copied from attnlab.model.gpt.power_as_tensor
def power_as_tensor(spec: AttentionSpec, device) -> tuple[AttentionSpec, torch.Tensor | None]:
    """``(spec the blocks see, p)``: a sharpened spec as the same spec with ``p = GRAPH_POWER`` and its power as a
    0-d float64 tensor on ``device`` (a tensor's value does not specialise a compiled graph; a float would, one
    graph per ``p_eval``); an unsharpened spec as itself and None (a second graph: one pass, not two)."""
    if spec.p is None:
        return spec, None
    return spec.replace(p=GRAPH_POWER), torch.tensor(spec.p, dtype=torch.float64, device=device)


def attention_spec(config: AttnlabConfig) -> AttentionSpec | PluginSpec:
    """The variant the config describes (a built-in's ``AttentionSpec`` fields, or a plugin's variant), with
    ``config.p_eval`` as its sharpening power."""
    fields = dict(config.attention or {})
    fields.pop("source", None)
    fields["p"] = None if config.p_eval is None else float(config.p_eval)
    if config.plugin is None:
        return AttentionSpec(**fields)
    variant = load_variant(config.plugin, fields["name"])
    if fields["p"] is not None and not variant.normalised:
        raise ValueError(f"p_eval={config.p_eval} is not allowed for attention {variant.name!r}: its rows are not "
                         "declared normalised; use p_eval=None")
    return PluginSpec(name=fields["name"], variant=variant, p=fields["p"],
                      position_bias=fields.get("position_bias", "none"), origin=config.plugin["origin"],
                      sha256=config.plugin["sha256"])


def trained_scaling(config: AttnlabConfig) -> TrainedScaling | None:
    """The RoPE scaling a run was fine-tuned with (attnlab's ``GPTConfig.trained_scaling``), None when it was not."""
    if config.trained_rope_scaling == "none" or config.original_len is None:
        return None
    return TrainedScaling(config.trained_rope_scaling, config.original_len, config.trained_rope_factor)


def attend(q, k, v, spec: AttentionSpec | PluginSpec, qk_gain=None, state=None, p=None) -> torch.Tensor:
    """attnlab's ``attend`` on its dense backend: a built-in variant's dense reference, or a plugin's reference."""
    if isinstance(spec, PluginSpec):
        return attend_reference(q, k, v, spec, state, p=p)
    return attend_dense(q, k, v, spec, qk_gain=qk_gain, p=p)


# Copied from attnlab.model.gpt.make_norm with GPTConfig->AttnlabConfig, cfg->config
def make_norm(config: AttnlabConfig) -> nn.Module:
    """The block's normalisation: LayerNorm (gpt2; with bias when ``config.bias``) or RMSNorm with a gain (llama)."""
    if config.block == "llama":
        return nn.RMSNorm(config.n_embd, eps=RMS_EPS)
    return nn.LayerNorm(config.n_embd, bias=config.bias)


class AttnlabAttention(nn.Module):
    def __init__(self, config: AttnlabConfig):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.residual_scaled = True
        spec = attention_spec(config)
        self.layer_shape = Shape(config.n_embd, config.n_head, config.n_embd // config.n_head)
        if spec.learned_qk_gain:  # QK-norm's learned per-channel gains (softmax_qknorm, softmax_qknorm_logn)
            self.q_gain = nn.Parameter(torch.ones(self.layer_shape.head_dim))
            self.k_gain = nn.Parameter(torch.ones(self.layer_shape.head_dim))
        plugin = build_params(spec, self.layer_shape) if isinstance(spec, PluginSpec) else None
        if plugin is not None:  # a plugin variant's learned parameters (blocks.N.attn.plugin.*)
            for module in plugin.modules():
                module.plugin_init = True
            self.plugin = plugin

    def forward(self, x, cos, sin, spec: AttentionSpec | PluginSpec, p: torch.Tensor | None = None):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if cos is not None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        gain = (self.q_gain, self.k_gain) if spec.learned_qk_gain else None
        state = None
        if isinstance(spec, PluginSpec):
            state = prepare_state(spec, x, getattr(self, "plugin", None), self.layer_shape)
        y = attend(q, k, v, spec, qk_gain=gain, state=state, p=p)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


# Copied from attnlab.model.gpt.MLP with GPTConfig->AttnlabConfig, cfg->config
class MLP(nn.Module):
    def __init__(self, config: AttnlabConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.residual_scaled = True

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


# Copied from attnlab.model.gpt.SwiGLU with GPTConfig->AttnlabConfig, cfg->config
class SwiGLU(nn.Module):
    """Llama's MLP (Shazeer 2020; Touvron et al. 2023): ``c_proj(silu(c_fc(x)) * c_up(x))``, hidden width
    ``config.mlp_hidden`` (8/3 x n_embd rounded up to 64), three projections without bias."""

    def __init__(self, config: AttnlabConfig):
        super().__init__()
        hidden = config.mlp_hidden
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=False)  # the gate (Llama's w1)
        self.c_up = nn.Linear(config.n_embd, hidden, bias=False)  # Llama's w3
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=False)  # Llama's w2
        self.c_proj.residual_scaled = True

    def forward(self, x):
        return self.c_proj(F.silu(self.c_fc(x)) * self.c_up(x))


class AttnlabBlock(nn.Module):
    def __init__(self, config: AttnlabConfig):
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = AttnlabAttention(config)
        self.ln_2 = make_norm(config)
        self.mlp = SwiGLU(config) if config.block == "llama" else MLP(config)

    def forward(self, x, cos, sin, spec: AttentionSpec | PluginSpec, p: torch.Tensor | None = None):
        x = x + self.attn(self.ln_1(x), cos, sin, spec, p)
        return x + self.mlp(self.ln_2(x))


class AttnlabPreTrainedModel(PreTrainedModel):
    config_class = AttnlabConfig
    config: AttnlabConfig
    base_model_prefix = "model"
    _no_split_modules = ["AttnlabBlock"]
    supports_gradient_checkpointing = False

    def _init_weights(self, module):
        """attnlab's initialisation (N(0, 0.02), residual projections 0.02 / sqrt(2 n_layer)), for a model built
        from a config alone; a loaded model's weights replace it. A plugin's parameters keep the plugin's own."""
        if getattr(module, "plugin_init", False):
            return
        std = 0.02
        if isinstance(module, nn.Linear):
            if getattr(module, "residual_scaled", False):
                std = std / math.sqrt(2 * self.config.n_layer)
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)


class AttnlabModel(AttnlabPreTrainedModel):
    """The token embedding, the blocks and the final norm: hidden states ``(B, T, n_embd)``."""

    def __init__(self, config: AttnlabConfig):
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(AttnlabBlock(config) for _ in range(config.n_layer))
        self.ln_f = make_norm(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.wte

    def set_input_embeddings(self, value):
        self.wte = value

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, **kwargs) -> BaseModelOutput:
        x = self.wte(input_ids) if inputs_embeds is None else inputs_embeds
        check_mask(attention_mask)
        T = x.shape[1]
        c = self.config
        c.validate_attnlab()  # p_eval and rope_scaling may have been changed since loading
        cos = sin = None
        if c.position == "rope":
            cos, sin = scaled_rope_tables(c.rope_scaling, T, c.n_embd // c.n_head, c.train_len, c.rope_base,
                                          device=x.device, trained=trained_scaling(c))
        spec, p = power_as_tensor(attention_spec(c), x.device)
        for block in self.blocks:
            x = block(x, cos, sin, spec, p)
        return BaseModelOutput(last_hidden_state=self.ln_f(x))


def check_mask(attention_mask) -> None:
    """Padding may only follow a sequence (right padding): a 0 before a 1 would shift every position after it."""
    if attention_mask is None or attention_mask.dim() != 2:
        return
    mask = attention_mask.to(torch.bool)
    if bool((~mask[:, :-1] & mask[:, 1:]).any()):
        raise ValueError("attention_mask has padding before or inside a sequence: this model counts positions from "
                         "the first token; pad on the right (tokenizer.padding_side = 'right')")


class AttnlabForCausalLM(AttnlabPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.wte.weight"}

    def __init__(self, config: AttnlabConfig):
        super().__init__(config)
        self.model = AttnlabModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.wte

    def set_input_embeddings(self, value):
        self.model.wte = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # no KV cache (module docstring)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        """The whole sequence at every step (no cache: the module docstring says why)."""
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def forward(self, input_ids=None, attention_mask=None, labels=None, inputs_embeds=None, logits_to_keep=0,
                **kwargs) -> CausalLMOutput:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds)
        h = hidden.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            h = h[:, -logits_to_keep:]
        logits = self.lm_head(h)
        loss = None
        if labels is not None:
            shifted = labels[:, 1:].reshape(-1)
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), shifted, ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)


__all__ = ["AttnlabForCausalLM", "AttnlabModel", "AttnlabPreTrainedModel"]
