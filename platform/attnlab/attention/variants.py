"""The registry of named attention variants: one entry per row of the paper's tables (docs/attention.md#variants).

Adding a variant is one entry here plus its test. Every entry is a plain :class:`AttentionSpec`; the math that
interprets the fields is in ``dense.py``. Unless stated, scores are ``q @ k^T / sqrt(d)``, causal, no QK-norm.

Variants loaded from plugins (``attention/plugin.py``, docs/plugins.md) are registered beside them as
:class:`PluginSpec` entries by :func:`register_plugin_spec`; a name never means two things.
"""

from __future__ import annotations

from attnlab.attention.spec import AttentionSpec, PluginSpec, parse_scale

_REGISTRY: dict[str, AttentionSpec] = {}
_ALIASES: dict[str, str] = {}
_PLUGINS: dict[str, PluginSpec] = {}  # loaded plugin variants, by name


def _register(spec: AttentionSpec, *aliases: str) -> None:
    _REGISTRY[spec.name] = spec
    for alias in aliases:
        _ALIASES[alias] = spec.name


# --- Table 1: is non-negativity needed? -------------------------------------------------------------------
_register(AttentionSpec("softmax", phi="exp", norm="l1", source="Tables 1-4: softmax (= exp + l1norm)"),
          "exp", "scenario_iv")
_register(AttentionSpec("softmax_inverse", phi="exp", norm="l1", post="negate", source="Table 1: -softmax"))
_register(AttentionSpec("softmax_recentred", phi="exp", norm="l1", post="recentre",
                        source="Table 1: softmax minus the row mean 1/N_i, first 3 rows untouched"))
_register(AttentionSpec("softmax_recentred_l1", phi="exp", norm="l1", post="recentre_l1",
                        source="Table 1: re-centred softmax, then l1norm"))

# --- Table 2: which half of softmax matters? --------------------------------------------------------------
_register(AttentionSpec("scenario_i", phi="identity", norm="none", source="Table 2 I: identity, no norm"))
_register(AttentionSpec("scenario_ii", phi="exp", norm="none", source="Table 2 II: exp, no norm"))
_register(AttentionSpec("scenario_iii", phi="identity", norm="l1", source="Table 2 III: identity + l1norm"))

# --- Table 3: activation swap, f(S) * M then l1norm ---------------------------------------------------------
for _phi in ("relu", "relu2", "relu6", "gelu", "sigmoid", "softplus", "mish"):
    _register(AttentionSpec(_phi, phi=_phi, norm="l1", source=f"Table 3: {_phi} + l1norm"))

# --- Table 4: softmax-free state of the art ---------------------------------------------------------------
_register(AttentionSpec("sigmoid_ramapuram", phi="sigmoid", norm="none", bias="neg_log_t",
                        source="Table 4: sigmoid(S - ln T), T = sequence length, no norm (Ramapuram et al.)"))
_register(AttentionSpec("sigmoid_ramapuram_b", phi="sigmoid", norm="none", bias="neg_log_n",
                        source="Table 4: sigmoid(S - ln N_i), no norm (inferred per-row b)"))
_register(AttentionSpec("sigmoid_ramapuram_b_l1", phi="sigmoid", norm="l1", bias="neg_log_n",
                        source="Table 4: sigmoid(S - ln N_i), then l1norm"))
_register(AttentionSpec("sigmoid_l1", phi="sigmoid", norm="l1", source="Table 4: sigmoid + l1norm (proposed)"))
_register(AttentionSpec("relu_wortsman", phi="relu", norm="count",
                        source="Table 4: relu(S) / N_i (Wortsman et al.; inferred: visible length)"))
_register(AttentionSpec("relu_l1", phi="relu", norm="l1", source="Table 4: relu + l1norm (Li et al.)"))
_register(AttentionSpec("relu_shen", phi="relu", norm="none", out_norm="layernorm",
                        source="Table 4: relu(S), then LayerNorm on each head's output (Shen et al.; inferred)"))
_register(AttentionSpec("lssa", phi="softplus", norm="l1", scale="logd_logn", qk_norm=True,
                        source="Eq. 4, Table 4: QK-norm, scale ln(d)*ln(N_i), softplus + l1norm"))
_register(AttentionSpec("lssar", phi="softplus", norm="l1", scale="logd_logn", qk_norm=True, p=15.0,
                        source="Eq. 5, Table 4: LSSA + sharpening, p = 15 by default"))

# --- modern softmax baselines (docs/attention.md#modern-softmax-baselines) -----------------------------------
_register(AttentionSpec("softmax_qknorm", phi="exp", norm="l1", qk_norm=True, qk_norm_gain="learned",
                        source="Baseline: softmax with QK-norm as OLMo 2 (Team OLMo 2024) and Qwen3/Gemma 3 do it: "
                               "RMSNorm of q and k over the head dimension with a learned per-channel gain (init "
                               "1, held by the model), then q.k/sqrt(d) (Dehghani et al. 2023 use LayerNorm)"))
_register(AttentionSpec("softmax_logn", phi="exp", norm="l1", scale="log_n",
                        source="Baseline: Scalable-Softmax (Nakanishi 2025) / Chiang & Cholak 2022: softmax of "
                               "s*ln(N_i)*q.k/sqrt(d) with s fixed at 1 (SSMax learns s per head, init ~0.43)"))
_register(AttentionSpec("softmax_qknorm_logn", phi="exp", norm="l1", scale="log_n", qk_norm=True,
                        qk_norm_gain="learned",
                        source="Baseline: softmax_qknorm and softmax_logn together: RMSNorm(q), RMSNorm(k) with "
                               "learned gains, scale ln(N_i)/sqrt(d)"))

# --- position bias: ALiBi (Press et al. 2022) on any variant with position_bias='alibi' ------------------------
# No registered name: the model sets it with dataclasses.replace(spec, position_bias="alibi") (model.position).

_OVERRIDABLE = ("p", "scale", "coef", "qk_norm", "phi", "norm", "bias", "post", "out_norm", "qk_norm_gain",
                "position_bias")
# A plugin variant's forms are its own: only sharpening and the position bias are chosen from outside.
_PLUGIN_OVERRIDABLE = ("p", "position_bias")


def variant_names() -> list[str]:
    """Every registered name, aliases and loaded plugin variants included, sorted."""
    return sorted([*_REGISTRY, *_ALIASES, *_PLUGINS])


def builtin_names() -> list[str]:
    """The built-in names and aliases (what a plugin variant's name must not be), sorted."""
    return sorted([*_REGISTRY, *_ALIASES])


def plugin_spec(name: str) -> PluginSpec | None:
    """The loaded plugin variant ``name`` (with no overrides), or None."""
    return _PLUGINS.get(name)


def register_plugin_spec(spec: PluginSpec) -> None:
    """Register a loaded plugin's variant (``attention/plugin.py`` checks collisions first)."""
    _PLUGINS[spec.name] = spec


def unregister_plugin_spec(name: str) -> None:
    _PLUGINS.pop(name, None)


def get_variant(name: str, **overrides) -> AttentionSpec:
    """The named variant, with fields overridden.

    ``p``: sharpening power (``None`` = none, otherwise a number >= 1). ``scale``: ``inv_sqrt_d``,
    ``log_n``, ``logd_logn``, ``coef*log_n`` (with ``coef=``), ``"2.5*log_n"``, or a bare number meaning
    ``<number>*log_n``. Other fields of :class:`AttentionSpec` may be overridden too.
    """
    if isinstance(name, str) and name in _PLUGINS:
        return _plugin_variant(_PLUGINS[name], overrides)
    if not isinstance(name, str) or (name not in _REGISTRY and name not in _ALIASES):
        raise ValueError(f"attention={name!r} is unknown: use one of {', '.join(variant_names())} "
                         "(or load the plugin that defines it: docs/plugins.md)")
    spec = _REGISTRY[_ALIASES.get(name, name)]
    unknown = sorted(set(overrides) - set(_OVERRIDABLE))
    if unknown:
        raise ValueError(f"attention override {unknown[0]!r} is unknown: use one of {', '.join(_OVERRIDABLE)}")
    changes = dict(overrides)
    if "scale" in changes:
        scale, coef = parse_scale(changes["scale"])
        changes["scale"] = scale
        if coef is not None:
            if changes.get("coef") not in (None, coef):
                raise ValueError(f"scale={overrides['scale']!r} and coef={changes['coef']!r} disagree: give one")
            changes["coef"] = coef
        elif scale != "coef*log_n":
            changes.setdefault("coef", None)
    elif "coef" in changes and changes["coef"] is not None:
        changes["scale"] = "coef*log_n"
    return spec.replace(**changes)


def _plugin_variant(spec: PluginSpec, overrides: dict) -> PluginSpec:
    unknown = sorted(k for k, v in overrides.items() if k not in _PLUGIN_OVERRIDABLE and v is not None)
    if unknown:
        raise ValueError(f"attention override {unknown[0]!r} does not apply to plugin variant {spec.name!r} (its "
                         f"forms are its own): only {', '.join(_PLUGIN_OVERRIDABLE)} may be overridden")
    return spec.replace(**{k: v for k, v in overrides.items() if k in _PLUGIN_OVERRIDABLE})
