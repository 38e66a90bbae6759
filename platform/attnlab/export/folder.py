"""``attnlab export``'s work: a run's latest checkpoint (or a given checkpoint) to a Hugging Face model folder.

Every check comes before anything is written, each a one-line :class:`UserError`: the run or checkpoint exists and
holds a checkpoint, the model is a text GPT with a tokenizer attnlab can write, a plugin variant's recorded source
matches its sha256 and imports nothing of attnlab but the plugin API, ``p_eval`` and ``rope_scaling`` are allowed,
and the destination is free (absent or an empty folder) unless ``overwrite``. Then the files are built in memory
and written to a staging place, and the folder appears at the end:

- a local destination: a hidden sibling folder (``.NAME.export-<hex>``) renamed into place (an existing folder is
  renamed aside first, then deleted), so a reader sees the old folder or the new one, never a mix;
- a bucket: the files are uploaded with ``config.json`` last (what transformers reads first), after any old folder
  was deleted; an interrupted upload leaves a folder without ``config.json``, which loads as nothing.

Imports model (checkpoints, config), attention (plugin sources), data (the tokeniser), location, runfolder and the
results store (the card's table); nothing of training or evaluation.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import shutil
import tempfile
import uuid

from attnlab.attention.plugin_source import PluginError, PluginSource
from attnlab.data.tokenizer import BYTES_EOT_ID, EOT_ID
from attnlab.errors import UserError
from attnlab.export.card import extrapolation_table, model_card
from attnlab.export.hf_format import (TEMPLATES, generation_config, hf_config, hf_weights, json_bytes,
                                      require_safetensors, safetensors_bytes, template_bytes)
from attnlab.export.tokenizer_files import tokenizer_files, tokenizer_kind
from attnlab.location import Location
from attnlab.model import config_from_dict
from attnlab.model.checkpoint import find_latest_checkpoint, load_state, local_checkpoint, run_of_checkpoint
from attnlab.names import check_scaling, parse_optional_number
from attnlab.runfolder import recorded_train_key

RUN_P = "run"  # p_eval's default: the power the run trained with
PLUGIN_DIR = "plugin"  # a readable copy of a plugin's files (the model runs the copy in config.json)


def export_run(source, to, *, store=None, overwrite: bool = False, p_eval=RUN_P,
               rope_scaling: str = "none") -> Location:
    """Export the latest checkpoint of run ``source`` (or the checkpoint ``source``) to the folder ``to`` (a path or
    a bucket URI); ``store``: a results store whose rows of the run give the card its extrapolation table. Returns
    the folder's location."""
    require_safetensors()
    checkpoint = find_latest_checkpoint(source)
    target = Location.parse(to, field="--to")
    run = run_of_checkpoint(checkpoint)
    if any(held.uri == target.uri or held.uri.startswith(target.uri.rstrip("/") + "/") for held in (checkpoint, run)):
        raise UserError(f"--to {target.uri} holds the run being exported ({run.uri}): give a folder outside it")
    check_target(target, overwrite)
    rope_scaling = check_scaling(rope_scaling, "--rope-scaling").label
    with local_checkpoint(checkpoint) as directory:
        state = load_state(directory)
    train = state.get("config") or {}
    fields = state.get("gpt_config") or {}
    if not fields:
        raise UserError(f"checkpoint {checkpoint.uri} records no gpt_config: it cannot be exported")
    if fields.get("model_kind", "gpt") != "gpt":
        raise UserError(f"checkpoint {checkpoint.uri} is a model_kind={fields['model_kind']!r} model (coordinate "
                        "tokens, no text tokenizer): only text GPT models are exported")
    plugin = plugin_record(train.get("plugin"), checkpoint)
    cfg = config_from_dict(fields)
    kind = tokenizer_kind(cfg.vocab_size)
    p = resolve_p_eval(cfg, p_eval)
    step = int(state.get("step", 0))
    record = {"checkpoint": checkpoint.uri, "step": step, "train_key": recorded_train_key(run),
              "tokens": step * int(train["tokens_per_step"]) if "tokens_per_step" in train else None,
              "attnlab_version": _version()}
    eot = BYTES_EOT_ID if kind == "bytes" else EOT_ID
    table = None if store is None else extrapolation_table(Location.parse(store, field="--store"),
                                                           record["train_key"])
    files = {
        "config.json": json_bytes(hf_config(cfg, eot_id=eot, p_eval=p, rope_scaling=rope_scaling, plugin=plugin,
                                            record=record)),
        "generation_config.json": json_bytes(generation_config(eot)),
        "model.safetensors": safetensors_bytes(hf_weights(state["model"])),
        **tokenizer_files(kind),
        **{name: template_bytes(name) for name in TEMPLATES},
        "README.md": model_card(cfg, record=record, train=train, tokenizer=kind, p_eval=p, rope_scaling=rope_scaling,
                                plugin=plugin, table=table).encode("utf-8"),
    }
    if plugin is not None:
        files.update({f"{PLUGIN_DIR}/{rel}": text.encode("utf-8") for rel, text in plugin["files"].items()})
    commit(files, target, overwrite)
    return target


def check_target(target: Location, overwrite: bool) -> None:
    """The destination must be absent or an empty folder, or ``overwrite`` given (and not a file)."""
    if not target.exists():
        return
    if not target.is_dir():
        raise UserError(f"--to {target.uri} is a file: give a folder to write the model into")
    if target.list_names() and not overwrite:
        raise UserError(f"--to {target.uri} already exists and is not empty: give another folder, or --overwrite to "
                        "replace it")


def plugin_record(recorded, checkpoint: Location) -> dict | None:
    """config.json's ``plugin``: the run's recorded plugin source, loaded (so its variant is known) after its files
    were checked against its sha256; None for a built-in variant. Its code may import attnlab's plugin API only."""
    if not recorded:
        return None
    from attnlab.attention.plugin import load_recorded

    try:
        source = PluginSource.from_dict(recorded)
    except (KeyError, TypeError, AttributeError, UnicodeError) as exc:
        raise UserError(f"checkpoint {checkpoint.uri}: its recorded plugin is malformed ({exc})") from None
    except PluginError as exc:
        raise UserError(f"checkpoint {checkpoint.uri}: {exc}; the plugin's code was changed after training") from None
    for rel, data in source.files.items():
        check_plugin_imports(rel, data)
    load_recorded(source, holder=f"checkpoint {checkpoint.uri}")
    return source.to_dict()


def check_plugin_imports(rel: str, data: bytes) -> None:
    """A plugin's file may import ``attnlab.attention.plugin`` (its API, provided in the folder) and no other attnlab
    module: an exported model runs where attnlab is not installed."""
    try:
        tree = ast.parse(data, rel)
    except SyntaxError as exc:
        raise UserError(f"plugin {rel}:{exc.lineno}: SyntaxError: {exc.msg}") from None
    allowed = {"attnlab", "attnlab.attention", "attnlab.attention.plugin"}
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parent = node.module in ("attnlab", "attnlab.attention")  # from attnlab.attention import plugin
            names = [f"{node.module}.{alias.name}" for alias in node.names] if parent else [node.module]
        for name in names:
            if (name == "attnlab" or name.startswith("attnlab.")) and name not in allowed:
                raise UserError(f"plugin {rel}:{node.lineno} imports {name}: an exported plugin may import "
                                "attnlab.attention.plugin only (the model folder runs without attnlab)")


def resolve_p_eval(cfg, p_eval) -> float | None:
    """``run``: the power the run trained with (None when unsharpened); else none or a number >= 1 the variant
    allows."""
    if p_eval == RUN_P:
        return cfg.attention_spec().p
    p = parse_optional_number(p_eval, "--p-eval", minimum=1.0)
    try:
        cfg.attention_spec(p=p)
    except ValueError as exc:
        raise UserError(f"--p-eval={p_eval!r}: {exc}") from None
    return p


def commit(files: dict[str, bytes], target: Location, overwrite: bool) -> None:
    """Write ``files`` ({relative path: bytes}) as the folder ``target``, whole (module docstring)."""
    if not target.is_local:
        with tempfile.TemporaryDirectory(prefix="attnlab-export-") as staging:
            _write_all(staging, files)
            check_target(target, overwrite)
            if target.exists():
                target.delete("")
            target.parent.upload(staging, target.name, last="config.json")
        return
    parent, name = os.path.dirname(target.path), os.path.basename(target.path)
    os.makedirs(parent, exist_ok=True)
    staging = os.path.join(parent, f".{name}.export-{uuid.uuid4().hex[:12]}")
    os.mkdir(staging)
    try:
        _write_all(staging, files)
        check_target(target, overwrite)  # again: something may have appeared there meanwhile
        if os.path.isdir(target.path):
            old = os.path.join(parent, f".{name}.old-{uuid.uuid4().hex[:12]}")
            os.rename(target.path, old)
            os.rename(staging, target.path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging, target.path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _write_all(folder: str, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = os.path.join(folder, *rel.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as out:
            out.write(data)


def _version() -> str | None:
    try:
        return importlib.metadata.version("attnlab")
    except importlib.metadata.PackageNotFoundError:
        return None
