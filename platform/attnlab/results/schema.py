"""The results-row schema: one long-format row per measured number (:data:`COLUMNS`), the registered metrics
(:data:`METRICS`, :func:`register_metric`), and the checks that refuse bad rows.

Owns what a row may say: *what was measured* (``metric``, ``value``), *on what* (``eval_len``, ``window_mode``,
``layer``, ``bucket``, ``n_tokens``), *for which configuration* (:data:`CONFIG_COLUMNS`) and *where it came from*
(``study``, ``trial``, ``train_key``, ``eval_key``, ``step``, ``git_sha``, ...), its ``schema_version``
(:data:`SCHEMA_VERSION`, a column and a file-metadata entry), and how older rows' names read today
(:data:`INPUT_ALIASES`: ``config_hash`` is ``train_key``; :func:`current_label`: ``yarn`` before schema 9 is
``yarn_paper``). An unregistered metric is refused, never dropped silently; NaN and infinite values are kept.

It must never import Ray, hold pandas-only logic or do file I/O: pure Python and pyarrow, read by the store and
the reports alike.

Details: docs/protocol.md#results-rows (the conventions), docs/results-store.md#rows-and-schema-versions (the
versions).
"""

from __future__ import annotations

import datetime as _dt
import math
import numbers
import re
from dataclasses import dataclass

import pyarrow as pa

from attnlab.errors import UserError
from attnlab.names import ROPE_SCALINGS, STUDY_NAME, STUDY_NAME_RULE, is_missing, parse_rope
from attnlab.states import StopReason

# 2: eval_key; 3: expression; 4: task, stderr; 5: stopped, stop_rule (rows of older versions read them as null);
# 6: train_key (the column versions 1-5 called config_hash); 7: plugin_sha256 (rows of older versions read it as null);
# 8: stage, parent_key, extension, ext_len, ext_tokens, lineage_tokens (a study's stages; null in older rows);
# 9: ext_factor (null in older rows), rope_scaling may carry a factor (dynamic:2), and yarn is the reference code's
# ramp: a row of versions 1-8 that says yarn was measured with the paper's ramp and reads as yarn_paper
# (current_label; rows are never rewritten)
SCHEMA_VERSION = 9
SCHEMA_VERSION_METADATA_KEY = b"attnlab.results.schema_version"

COMPLETE_METRIC = "complete"
# The orbit study's law row: the recovered force law's distance from Newton's; it carries the expression, and a
# store with rows of it is an orbit study's (reports, the page and ``attnlab eval`` show its laws table).
LAW_METRIC = "force_newton_dist"
STOPPED_VALUES = tuple(s.value for s in StopReason)  # the stopped column: how a run with a stopping rule ended


@dataclass(frozen=True)
class Column:
    """One column of the results schema."""

    name: str
    kind: str  # "str", "int", "float", "timestamp"
    required: bool
    doc: str


COLUMNS: tuple[Column, ...] = (
    Column("study", "str", True, "study name (also the store folder study=<name>/)"),
    Column("trial", "str", True, "the Tune trial that measured the row (a study), or the run folder's name "
                                 "(attnlab eval): a label; the run's identity is train_key"),
    Column("attention", "str", True, "attention variant name, e.g. softmax, lssa, sigmoid_l1"),
    Column("scale", "str", True, 'scale factor, e.g. "logd_logn", "inv_sqrt_d", "coef*log_n:0.8"'),
    Column("p_train", "float", False, "sharpening power used in training; null = none"),
    Column("p_eval", "float", False, "sharpening power applied at evaluation only; null = none"),
    Column("rope_scaling", "str", True, "RoPE scaling at evaluation: ntk | none | pi | yarn | yarn_paper | "
                                        "dynamic:F (rows of schema 1-8 saying yarn read as yarn_paper)"),
    Column("step", "int", True, "training step of the evaluated weights"),
    Column("tokens", "int", True, "training tokens seen at that step"),
    Column("eval_len", "int", True, "evaluation length (tokens per window)"),
    Column("train_len", "int", True, "training context length (a stage with a parent: its lineage's first length; "
                                     "ext_len is its own)"),
    Column("window_mode", "str", True, 'how windows were cut: "nonoverlap", "long_docs", "passkey", ...'),
    Column("metric", "str", True, "metric name (see METRICS)"),
    Column("value", "float", True, "the measured number (NaN/inf allowed: diverged runs)"),
    Column("seed", "int", True, "training seed of the trial"),
    Column("train_key", "str", True, "the training run's identity (TrainConfig.train_key); stores of schema 1-5 "
                                     "called it config_hash"),
    Column("git_sha", "str", True, 'code version ("unknown" when not in a git checkout)'),
    Column("layer", "int", False, "layer index for per-layer diagnostics; null = whole model"),
    Column("bucket", "str", False, 'position bucket ("early"/"middle"/"late") or key depth; null = all'),
    Column("n_tokens", "int", False, "number of tokens the metric was computed on"),
    Column("preset", "str", False, "model preset name"),
    Column("data", "str", False, "data set / folder the metric was computed on"),
    Column("knobs", "str", False, 'other searched settings of the trial, e.g. "lr=0.001,model.n_layer=4"'),
    Column("eval_key", "str", False, "identity of the evaluation cell the row belongs to (see attnlab.evaluate.plan)"),
    Column("expression", "str", False, "a recovered formula, e.g. the force law of the orbit study's probe; null = none"),
    Column("task", "str", False, "downstream task (lm-evaluation-harness name, e.g. hellaswag); null = none"),
    Column("stderr", "float", False, "standard error of value as the task's harness reports it; null = none"),
    Column("stopped", "str", False, "how training ended under a stopping rule (train.stop_when): reached (the rule was "
                                    "met at step) or cap (the step cap came first); null = no rule"),
    Column("stop_rule", "str", False, "the training run's stopping rule, e.g. 'val_acc >= 0.99'; null = none"),
    Column("plugin_sha256", "str", False, "sha256 of the source of the attention plugin the run's variant comes from "
                                          "(docs/plugins.md): the code it trained with; null = a built-in variant"),
    Column("stage", "str", False, "the study stage that trained a run started from a parent's weights (docs/stages.md); "
                                  "null = the study's own train/space (the root, pretrain), or no stages"),
    Column("parent_key", "str", False, "train_key of the run whose final weights this run started from; null = trained "
                                       "from scratch"),
    Column("extension", "str", False, "the RoPE scaling applied in training by a stage with a parent: none (continued "
                                      "training at the longer length), pi, ntk, yarn, yarn_paper or dynamic (its "
                                      "factor: ext_factor); null = trained from scratch"),
    Column("ext_factor", "float", False, "the scale factor of the RoPE scaling in training (a stage's factor, or "
                                         "ext_len / train_len when it sets none); null = trained from scratch, or "
                                         "plain RoPE (extension none)"),
    Column("ext_len", "int", False, "the training length of a stage with a parent (train_len is then its lineage's "
                                    "first length, which evaluation multiples count from); null = none"),
    Column("ext_tokens", "int", False, "training tokens of the stage with a parent, at the evaluated step; null = none"),
    Column("lineage_tokens", "int", False, "training tokens of the whole lineage at the evaluated step (the parents' "
                                           "and this run's); null = trained from scratch (tokens says it)"),
    Column("created_at", "timestamp", False, "when the row was written (UTC); filled on write"),
    Column("schema_version", "int", True, "schema version of the writer; filled on write"),
)
STORED_NAMES = tuple(c.name for c in COLUMNS)  # the columns of a stored row, in order
_BY_NAME = {c.name: c for c in COLUMNS}

# Older names of columns, accepted by ResultsStore.write and in read filters: {old name: column}. ``config_hash`` is
# what schema versions 1-5 called ``train_key`` (a writer outside this package may still send it).
INPUT_ALIASES = {"config_hash": "train_key"}

# Columns that identify a configuration (what reports group by); seeds are averaged over.
CONFIG_COLUMNS = (
    "attention", "scale", "p_train", "p_eval", "rope_scaling", "train_len", "preset", "data", "knobs",
    "window_mode", "layer", "bucket", "task", "plugin_sha256", "stage", "extension", "ext_factor", "ext_len",
    "ext_tokens",
)

# The columns that name a RoPE scaling, and the schema version from which their ``yarn`` is the reference code's ramp
# (model/rope.py): before it, ``yarn`` was the paper's ramp, now ``yarn_paper``.
SCALING_COLUMNS = ("rope_scaling", "extension")
YARN_REFERENCE_SINCE = 9


def current_label(value, schema_version):
    """A scaling column's value as this version names it: ``yarn`` in a row of a schema version before
    :data:`YARN_REFERENCE_SINCE` is ``yarn_paper``; anything else is itself."""
    if value == "yarn" and not is_missing(schema_version) and int(schema_version) < YARN_REFERENCE_SINCE:
        return "yarn_paper"
    return value


def stored_labels(value) -> list:
    """What a row asking for scaling ``value`` may store (the older spelling too): ``yarn_paper`` may be stored as
    ``yarn`` (by schema versions before :data:`YARN_REFERENCE_SINCE`); select with these, then keep the rows whose
    :func:`current_label` is ``value``."""
    return [value, "yarn"] if value == "yarn_paper" else [value]

_ARROW_TYPES = {
    "str": pa.string(),
    "int": pa.int64(),
    "float": pa.float64(),
    "timestamp": pa.timestamp("us", tz="UTC"),
}

ARROW_SCHEMA = pa.schema(
    [pa.field(c.name, _ARROW_TYPES[c.kind], nullable=not c.required) for c in COLUMNS],
    metadata={SCHEMA_VERSION_METADATA_KEY: str(SCHEMA_VERSION).encode()},
)



@dataclass(frozen=True)
class Metric:
    """A registered metric name: whether a higher value is better (used by rankings) and what it means."""

    name: str
    higher_is_better: bool
    doc: str


METRICS: dict[str, Metric] = {}


def register_metric(name: str, higher_is_better: bool, doc: str = "") -> Metric:
    """Add a metric name to the registry (idempotent for the same definition)."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise UserError(f"metric name {name!r} must be lower_snake_case (letters, digits, underscores)")
    metric = Metric(name, higher_is_better, doc)
    METRICS[name] = metric
    return metric


for _name, _higher, _doc in (
    ("val_loss", False, "mean next-token cross-entropy (nats) over all window positions"),
    ("bpb", False, "bits per UTF-8 byte"),
    ("loss_bucket", False, "cross-entropy over one position bucket of the window (see bucket)"),
    ("loss", False, "cross-entropy of a probe or task"),
    ("train_loss", False, "training loss"),
    ("perplexity", False, "exp(cross-entropy)"),
    ("acc", True, "accuracy of a probe / multiple-choice task"),
    # downstream tasks (lm-evaluation-harness, attnlab.evaluate.downstream); the row's task column names the task
    ("acc_norm", True, "downstream: multiple-choice accuracy, each choice scored per character of its text"),
    ("word_perplexity", False, "downstream: perplexity per word of a rolling-loglikelihood task"),
    ("byte_perplexity", False, "downstream: perplexity per UTF-8 byte of a rolling-loglikelihood task"),
    ("exact_match", True, "downstream: fraction of exact answers"),
    ("f1", True, "downstream: F1 score"),
    ("mcc", True, "downstream: Matthews correlation coefficient"),
    ("passkey_acc", True, "passkey retrieval accuracy (true key ranked first among distractors)"),
    ("passkey_rank", False, "mean rank of the true passkey among distractors (0 = first)"),
    ("entropy", False, "mean attention-row entropy (nats), per layer"),
    ("sink_mass", False, "mean attention weight on the first token, per layer"),
    # orbit tokens (attnlab.data.generators.orbits): how far the predicted (x, y) bins land from the true ones
    ("coord_err", False, "orbit tokens: mean distance between the argmax (x, y) bins and the target bins (bins)"),
    ("coord_err_au", False, "orbit tokens: the same distance in AU (bins x the source's bin width)"),
    # the orbit study's force probe (attnlab.evaluate.force_probe) and the law recovered from its forces
    ("force_probe_err", False, "force probe: mean |log(F_pred / F_true)| over held-out planet tokens (nats)"),
    ("force_probe_r2", True, "force probe: R^2 of log F over held-out planet tokens"),
    ("force_sr_err", False, "symbolic regression of the probe's forces: mean |log(f / F_pred)| (nats)"),
    ("force_exp_r", False, "local exponent d log f / d log r of the recovered law (Newton: -2)"),
    ("force_exp_m1", True, "local exponent of the recovered law in the planet mass (Newton: 1)"),
    ("force_exp_m2", True, "local exponent of the recovered law in the star mass (Newton: 1)"),
    ("force_exp_spread", False, "largest interquartile range of the local exponents (0 = a power law)"),
    (LAW_METRIC, False, "max |exponent - Newton's| of the recovered law over r, m1, m2 (row carries the "
                                 "expression)"),
    ("force_is_newton", True, "1 if the recovered law is Newton's within tolerance (exponents and spread)"),
    ("force_pl_exp_r", False, "power-law fit of the probe's forces: exponent of r (Newton: -2)"),
    ("force_pl_exp_m1", True, "power-law fit: exponent of the planet mass (Newton: 1)"),
    ("force_pl_exp_m2", True, "power-law fit: exponent of the star mass (Newton: 1)"),
    ("force_pl_rmse", False, "power-law fit: RMS residual of log F (nats)"),
    ("force_pl_newton_dist", False, "power-law fit: max |exponent - Newton's|"),
    (COMPLETE_METRIC, True, "marker of schema version 1 stores: a trial had written its results (ignored)"),
):
    register_metric(_name, _higher, _doc)


# Metrics whose every value lies in a known range (fractions of right answers, a correlation, a share of attention
# weight): the reports keep the intervals of their means and their error bars inside it, and show the seeds' own
# values instead of a t interval when n is small (attnlab.results.stats.SMALL_N). Metrics not listed (losses,
# perplexities, ranks, exponents, distances) are unbounded. ``f1`` is not listed: harness tasks report it either
# as a fraction or in percent (squad_v2), so no one range is right for it. A one-sided range uses infinity.
METRIC_BOUNDS: dict[str, tuple[float, float]] = {
    "acc": (0.0, 1.0),
    "acc_norm": (0.0, 1.0),
    "exact_match": (0.0, 1.0),
    "passkey_acc": (0.0, 1.0),
    "mcc": (-1.0, 1.0),
    "sink_mass": (0.0, 1.0),
    "force_is_newton": (0.0, 1.0),
    "force_probe_r2": (-math.inf, 1.0),
}


def metric_bounds(metric) -> tuple[float, float] | None:
    """``(low, high)`` that every value of ``metric`` lies in (:data:`METRIC_BOUNDS`), or None when unbounded."""
    return METRIC_BOUNDS.get(metric) if isinstance(metric, str) else None


def describe_schema() -> str:
    """A human-readable listing of the columns (for --help and docs)."""
    lines = [f"results schema v{SCHEMA_VERSION}:"]
    for c in COLUMNS:
        flag = "required" if c.required else "nullable"
        lines.append(f"  {c.name:<15} {c.kind:<9} {flag:<8} {c.doc}")
    return "\n".join(lines)


def _describe_row(index: int, row: dict) -> str:
    parts = [f"row {index}"]
    ident = [f"{k}={row[k]!r}" for k in ("trial", "metric", "eval_len") if k in row and not is_missing(row[k])]
    if ident:
        parts.append("(" + ", ".join(ident) + ")")
    return " ".join(parts)


def _coerce(column: Column, value, where: str):
    """Return the stored form of one cell, or raise UserError naming the row and column."""
    name = column.name
    if is_missing(value) and not (name == "value" and isinstance(value, numbers.Real)):
        # Outside ``value``, NaN is how pandas spells "missing" (e.g. p_eval = none, an empty bucket);
        # in ``value`` a NaN is a measured number (a diverged run).
        if column.required:
            raise UserError(f"results {where}: column {name!r} is required ({column.doc}), got a missing value")
        return None
    kind = column.kind
    if kind == "str":
        if not isinstance(value, str) or not value:
            raise UserError(f"results {where}: column {name!r} must be a non-empty string, got {value!r}")
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise UserError(f"results {where}: column {name!r} must be an integer, got {value!r}")
        if isinstance(value, numbers.Integral):
            return int(value)
        if math.isfinite(value) and float(value).is_integer():
            return int(value)
        raise UserError(f"results {where}: column {name!r} must be an integer, got {value!r}")
    if kind == "float":
        if name in ("p_train", "p_eval") and isinstance(value, str) and value.strip().lower() == "none":
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise UserError(f"results {where}: column {name!r} must be a number, got {value!r}")
        value = float(value)
        if name != "value" and not math.isfinite(value):
            raise UserError(f"results {where}: column {name!r} must be finite, got {value!r}")
        return value
    if kind == "timestamp":
        if isinstance(value, str):
            try:
                value = _dt.datetime.fromisoformat(value)
            except ValueError:
                raise UserError(
                    f"results {where}: column {name!r} must be a datetime or ISO-8601 string, got {value!r}"
                ) from None
        if hasattr(value, "to_pydatetime"):
            value = value.to_pydatetime()
        if not isinstance(value, _dt.datetime):
            raise UserError(f"results {where}: column {name!r} must be a datetime, got {value!r}")
        if value.tzinfo is None:
            value = value.replace(tzinfo=_dt.timezone.utc)
        return value.astimezone(_dt.timezone.utc)
    raise AssertionError(kind)  # pragma: no cover


def _current_names(row: dict, where: str) -> dict:
    """``row`` with its columns under their current names (:data:`INPUT_ALIASES`: ``config_hash`` -> ``train_key``);
    an old and a current name giving two different values are refused."""
    if not any(old in row for old in INPUT_ALIASES):
        return row
    row = dict(row)
    for old, new in INPUT_ALIASES.items():
        if old not in row:
            continue
        value, current = row.pop(old), row.get(new)
        if is_missing(current):
            row[new] = value
        elif not is_missing(value) and value != current:
            raise UserError(f"results {where}: column {old!r} is {value!r} but {new!r} is {current!r}; {old!r} is the "
                            f"old name of {new!r}: send one of them")
    return row


def validate_row(row: dict, index: int = 0, now: _dt.datetime | None = None) -> dict:
    """Check one row against the schema and return it in stored form (all columns present).

    Raises ``UserError`` naming the row and the column on: an unknown column, a missing required
    column, a wrong type, an unregistered metric, an unknown rope_scaling, a bad study name, or a
    negative length/step/token count.
    """
    if not isinstance(row, dict):
        raise UserError(f"results row {index}: must be a mapping of column -> value, got {type(row).__name__}")
    where = _describe_row(index, row)
    row = _current_names(row, where)
    unknown = sorted(set(row) - set(STORED_NAMES))
    if unknown:
        raise UserError(
            f"results {where}: unknown column {unknown[0]!r}; allowed: {', '.join(STORED_NAMES)}"
        )
    out = {}
    for column in COLUMNS:
        if column.name == "schema_version":
            given = row.get("schema_version")
            if not is_missing(given) and given != SCHEMA_VERSION:
                raise UserError(
                    f"results {where}: column 'schema_version' is {given!r}; this writer only writes "
                    f"version {SCHEMA_VERSION}"
                )
            out["schema_version"] = SCHEMA_VERSION
            continue
        if column.name == "created_at" and is_missing(row.get("created_at")):
            out["created_at"] = now or _dt.datetime.now(_dt.timezone.utc)
            continue
        if column.name not in row and column.required:
            raise UserError(f"results {where}: missing required column {column.name!r} ({column.doc})")
        out[column.name] = _coerce(column, row.get(column.name), where)

    if out["metric"] not in METRICS:
        raise UserError(
            f"results {where}: unknown metric {out['metric']!r}; registered: {', '.join(sorted(METRICS))} "
            "(add one with attnlab.results.register_metric)"
        )
    try:
        rope = parse_rope(out["rope_scaling"])
    except UserError:
        rope = None
    if rope is None or rope.label != out["rope_scaling"]:
        raise UserError(
            f"results {where}: column 'rope_scaling' is {out['rope_scaling']!r}; allowed: {', '.join(ROPE_SCALINGS)} "
            "(dynamic with its factor: dynamic:2)"
        )
    if out["stopped"] is not None and out["stopped"] not in STOPPED_VALUES:
        raise UserError(f"results {where}: column 'stopped' is {out['stopped']!r}; allowed: "
                        f"{', '.join(STOPPED_VALUES)} or null (no stopping rule)")
    if not STUDY_NAME.match(out["study"]):
        raise UserError(f"results {where}: column 'study' is {out['study']!r}; use {STUDY_NAME_RULE}")
    if out["extension"] is not None and out["extension"] not in ROPE_SCALINGS:
        raise UserError(f"results {where}: column 'extension' is {out['extension']!r}; allowed: "
                        f"{', '.join(ROPE_SCALINGS)} or null (trained from scratch)")
    for name in ("step", "tokens", "seed", "n_tokens", "layer", "ext_tokens", "lineage_tokens"):
        if out[name] is not None and out[name] < 0:
            raise UserError(f"results {where}: column {name!r} must be >= 0, got {out[name]}")
    if out["ext_factor"] is not None and out["ext_factor"] < 1:
        raise UserError(f"results {where}: column 'ext_factor' must be >= 1, got {out['ext_factor']}")
    for name in ("eval_len", "train_len", "ext_len"):
        if out[name] is not None and out[name] <= 0:
            raise UserError(f"results {where}: column {name!r} must be > 0, got {out[name]}")
    return out


def rows_to_table(rows: list[dict]) -> pa.Table:
    """Validate rows and build an Arrow table in the stored schema (raises UserError on the first bad row)."""
    now = _dt.datetime.now(_dt.timezone.utc)
    checked = [validate_row(row, i, now) for i, row in enumerate(rows)]
    columns = {name: [r[name] for r in checked] for name in STORED_NAMES}
    return pa.Table.from_pydict(columns, schema=ARROW_SCHEMA)


def empty_table() -> pa.Table:
    """A table with the stored schema and no rows."""
    return ARROW_SCHEMA.empty_table()
