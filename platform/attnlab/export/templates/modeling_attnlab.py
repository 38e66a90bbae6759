"""A GPT trained with attnlab, as a transformers model (remote code written by ``attnlab export``):
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)``, with no network and no attnlab.

Read top to bottom, it is attnlab's model (attnlab/model/gpt.py): GPT-2's block (pre-LayerNorm with biases, tanh-GELU
MLP) or Llama's (pre-RMSNorm, SwiGLU, no biases), tied input/output embeddings, no position table; RoPE (rotating q
and k, with the ``rope_scaling`` chosen in the config, on top of the ``trained_rope_scaling`` of a run fine-tuned
with one), NoPE or ALiBi; the attention variant of the run (``attention_attnlab.py``: every built-in variant,
sharpened with ``p_eval``; or an attnlab plugin's own code, ``plugin_attnlab.py``). Its logits are attnlab's to
float32 rounding.

Generation: ``model.generate`` works, with **no KV cache**: every step runs the whole sequence again. That is what
the variants need: the NTK base (and PI/YaRN) depend on the current length, ``sigmoid_ramapuram`` reads ``-ln T``, and
a variant whose rows are normalised over the whole row is recomputed, so each new token is exactly the model's
prediction for the sequence so far. An ``attention_mask`` may mark padding after a sequence (right padding), never
before it or inside it: positions are counted from the first token.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput

from .attention_attnlab import Spec, apply_rope, attend, rope_tables
from .configuration_attnlab import AttnlabConfig
from .plugin_attnlab import Shape, load_plugin


def attention_spec(config: AttnlabConfig) -> Spec:
    """The variant the config describes, with ``config.p_eval`` as its sharpening power."""
    fields = dict(config.attention or {})
    fields.pop("source", None)
    fields["p"] = None if config.p_eval is None else float(config.p_eval)
    if config.plugin is not None:
        plugin = load_plugin(config.plugin, fields["name"])
        if fields["p"] is not None and not plugin.variant.normalised:
            raise ValueError(f"p_eval={config.p_eval} is not allowed for attention {plugin.name!r}: its rows are not "
                             "declared normalised; use p_eval=None")
        return Spec(name=fields["name"], p=fields["p"], position_bias=fields.get("position_bias", "none"),
                    plugin=plugin)
    return Spec(**fields)


def make_norm(config: AttnlabConfig) -> nn.Module:
    if config.block == "llama":
        return nn.RMSNorm(config.n_embd, eps=config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)


class AttnlabAttention(nn.Module):
    def __init__(self, config: AttnlabConfig):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.residual_scaled = True
        spec = attention_spec(config)
        self.shape = Shape(config.n_embd, config.n_head, config.n_embd // config.n_head)
        if spec.learned_qk_gain:  # QK-norm's learned per-channel gains (softmax_qknorm, softmax_qknorm_logn)
            self.q_gain = nn.Parameter(torch.ones(self.shape.head_dim))
            self.k_gain = nn.Parameter(torch.ones(self.shape.head_dim))
        if spec.plugin is not None:
            params = spec.plugin.build_params(self.shape)
            if params is not None:  # a plugin variant's learned parameters (blocks.N.attn.plugin.*)
                for module in params.modules():
                    module.plugin_init = True
                self.plugin = params

    def forward(self, x, cos, sin, spec: Spec):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if cos is not None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        gain = (self.q_gain, self.k_gain) if spec.learned_qk_gain else None
        state = None
        if spec.plugin is not None:
            state = spec.plugin.prepare(x, getattr(self, "plugin", None), self.shape)
        y = attend(q, k, v, spec, qk_gain=gain, state=state)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class AttnlabMLP(nn.Module):
    """GPT-2's MLP (tanh-GELU) or Llama's SwiGLU (``c_proj(silu(c_fc(x)) * c_up(x))``)."""

    def __init__(self, config: AttnlabConfig):
        super().__init__()
        self.swiglu = config.block == "llama"
        self.c_fc = nn.Linear(config.n_embd, config.mlp_hidden, bias=config.bias)
        if self.swiglu:
            self.c_up = nn.Linear(config.n_embd, config.mlp_hidden, bias=False)
        self.c_proj = nn.Linear(config.mlp_hidden, config.n_embd, bias=config.bias)
        self.c_proj.residual_scaled = True

    def forward(self, x):
        if self.swiglu:
            return self.c_proj(F.silu(self.c_fc(x)) * self.c_up(x))
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class AttnlabBlock(nn.Module):
    def __init__(self, config: AttnlabConfig):
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = AttnlabAttention(config)
        self.ln_2 = make_norm(config)
        self.mlp = AttnlabMLP(config)

    def forward(self, x, cos, sin, spec: Spec):
        x = x + self.attn(self.ln_1(x), cos, sin, spec)
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
            cos, sin = rope_tables(c.rope_scaling, T, c.n_embd // c.n_head, c.train_len, c.rope_base, x.device,
                                   c.trained_rope_scaling, c.original_len, c.trained_rope_factor)
        spec = attention_spec(c)
        for block in self.blocks:
            x = block(x, cos, sin, spec)
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
