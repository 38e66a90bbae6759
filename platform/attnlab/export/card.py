"""The model card (``README.md``) of an exported folder: what the model is, where its attention's formula comes from,
what it trained on and for how long, its training key, how to load it, and, when a results store is given, its
length-extrapolation table (validation loss by evaluation length, as ``attnlab results table`` prints it).

Reads the results store (one training key's rows) and nothing else; pure text otherwise.
"""

from __future__ import annotations

import json

from attnlab.attention.spec import AttentionSpec, PluginSpec
from attnlab.errors import UserError
from attnlab.location import Location
from attnlab.model.config import GPTConfig

CARD_METRIC = "val_loss"
PAPER = ("Gao & Spratling, *Softplus Attention with Re-weighting Boosts Length Extrapolation in Large Language "
         "Models*, arXiv 2501.13428")


def extrapolation_table(store: Location, train_key: str | None) -> str:
    """The run's validation loss by evaluation length from the store, as Markdown (a sentence when it has none)."""
    from attnlab.results import ResultsStore
    from attnlab.results.reports import table, to_markdown

    if not train_key:
        return "The run folder records no training key, so the results store cannot be searched for its rows."
    rows = ResultsStore(store).read(train_key=train_key)
    if len(rows) and "task" in rows.columns:
        rows = rows[rows["task"].isna()]  # downstream tasks' rows are not windows of the validation split
    if not len(rows) or not (rows["metric"] == CARD_METRIC).any():
        return f"The results store {store.uri} holds no `{CARD_METRIC}` rows of training key `{train_key}`."
    try:
        return to_markdown(table(rows, metric=CARD_METRIC))
    except UserError as exc:
        return f"The results store {store.uri} has no table for training key `{train_key}`: {exc}"


def _variant_lines(spec: AttentionSpec | PluginSpec, plugin: dict | None) -> list[str]:
    if isinstance(spec, PluginSpec):
        source = getattr(spec.variant, "source", "") or "(the plugin gives no citation)"
        return [f"- **{spec.name}**, an attnlab plugin variant: {source}",
                f"- its code: `{plugin['origin']}` (sha256 `{plugin['sha256']}`), in `config.json` (`plugin`), checked "
                "against that sha256 every time the model is built"]
    fields = ", ".join(f"{k}={v}" for k, v in (("phi", spec.phi), ("norm", spec.norm), ("scale", spec.scale_label),
                                                 ("qk_norm", spec.qk_norm), ("bias", spec.bias), ("post", spec.post),
                                                 ("out_norm", spec.out_norm)) if v not in ("none", False))
    return [f"- **{spec.name}**: {spec.source or 'an attnlab variant'}",
            f"- its form: {fields} (attnlab's docs/attention.md); tables and equations are those of {PAPER}"]


def _trained_scaling_lines(cfg: GPTConfig, rope_scaling: str) -> list[str]:
    """A run fine-tuned with a RoPE scaling in training (a context-extension stage): what that scaling is and how the
    evaluation-time ``rope_scaling`` acts with it."""
    trained = cfg.trained_scaling
    if trained is None:
        return []
    return [f"- fine-tuned with RoPE scaling `{trained.method}` (factor {trained.scale(cfg.train_len):g}) in "
            f"training, from {trained.original_len} to {cfg.train_len} tokens (`attnlab_trained_rope_scaling`, "
            f"`attnlab_trained_rope_factor` and `original_len` in config.json): the model uses {trained.method}'s "
            f"frequencies with that factor at every length; `rope_scaling` "
            f"(`{rope_scaling}`) is an evaluation-time scaling applied on top of it beyond {cfg.train_len} tokens"]


def _lengths(cfg: GPTConfig) -> str:
    if cfg.original_len is not None and cfg.original_len < cfg.train_len:
        return f"trained at {cfg.original_len} tokens, then fine-tuned at {cfg.train_len}"
    return f"trained at {cfg.train_len} tokens"


def model_card(cfg: GPTConfig, *, record: dict, train: dict, tokenizer: str, p_eval: float | None,
               rope_scaling: str, plugin: dict | None, table: str | None) -> str:
    """README.md of the folder. ``record``: config.json's ``attnlab`` (checkpoint, step, train key); ``train``: the
    run's recorded training config; ``table``: the extrapolation table (None: no store given)."""
    spec = cfg.attention_spec()
    tokens = record.get("tokens")
    data = train.get("data")
    lines = [
        "---", "library_name: transformers", "tags:", "- attnlab", "- length-extrapolation", "- custom_code", "---", "",
        f"# attnlab GPT: {spec.name} attention, {cfg.block} block, {cfg.position} positions", "",
        f"Exported by `attnlab export` from `{record['checkpoint']}` (step {record['step']}). The modeling code in "
        "this folder is self-contained PyTorch: transformers loads it with `trust_remote_code=True`, offline, "
        "without attnlab, and its logits equal attnlab's to float32 rounding.", "",
        "## Attention", "",
        *_variant_lines(spec, plugin),
        f"- sharpening: p_train = {spec.p if spec.p is not None else 'none'}; `p_eval` in config.json = "
        f"{p_eval if p_eval is not None else 'none'} (change it after loading: `model.config.p_eval = 4`)",
        f"- position: {cfg.position}" + (f" (RoPE base {cfg.rope_base:g}; `rope_scaling` = `{rope_scaling}` beyond "
                                         f"{cfg.train_len} tokens: none, ntk, pi or yarn)" if cfg.position == "rope"
                                         else ""),
        *_trained_scaling_lines(cfg, rope_scaling), "",
        "## Model", "",
        f"{cfg.n_layer} layers, {cfg.n_head} heads, width {cfg.n_embd}, {cfg.block} block, vocabulary "
        f"{cfg.vocab_size} ({tokenizer} tokenizer), {_lengths(cfg)}, tied embeddings.", "",
        "## Training", "",
        f"- data: `{data if isinstance(data, str) else json.dumps(data)}`",
        f"- tokens: {tokens:,}" if isinstance(tokens, int) else "- tokens: not recorded",
        f"- training key: `{record.get('train_key') or 'not recorded'}`",
        f"- preset {train.get('preset', '?')}, seed {train.get('seed', '?')}, {train.get('tokens_per_step', '?')} "
        "tokens per step", "",
        "## Length extrapolation", "",
        table if table is not None else "No results store was given to `attnlab export` (`--store STORE` adds the "
                                        "run's table here).", "",
        "## Use", "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "model = AutoModelForCausalLM.from_pretrained(FOLDER, trust_remote_code=True)",
        "tokenizer = AutoTokenizer.from_pretrained(FOLDER, trust_remote_code=True)",
        "```", "",
        f"The tokenizer ({tokenizer}) is in GPT-2's format: `GPT2Tokenizer.from_pretrained(FOLDER)` loads it too, "
        "running none of this folder's code. Without `trust_remote_code`, `AutoTokenizer` first asks whether to run "
        "it (config.json names it) and then loads the same tokenizer.", "",
        "`model.generate` recomputes the whole sequence at every step (no KV cache: the RoPE scalings and some "
        "variants depend on the current length). Pad on the right only.", "",
    ]
    return "\n".join(lines)
