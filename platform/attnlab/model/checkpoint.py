"""Checkpoints: what one holds (model, optimiser, step, data position, RNG states, config) and how to find
the latest one in a run folder, local or on object storage. Both Ray Train's ``checkpoint_*`` folders and
plain-process ``checkpoints/step_*`` folders are understood. Training writes them and evaluation reads them;
this module is below both. No Ray here.

The CUDA RNG state saved is the one of the process's own device (``torch.cuda.current_device()``: Ray Train sets
it to the rank's GPU), never a list of every visible GPU: Ray Train shares ``CUDA_VISIBLE_DEVICES`` across a
node's workers, so such a list held 8 states on an 8-GPU node and could not be restored where fewer GPUs are
visible (``--workers`` lowered, ``--local``, a restart on smaller nodes). Restoring sets the state of the
process's own device; an old checkpoint's list restores the entry of that device (as ``set_rng_state_all`` did),
or the first one when the list is shorter.
"""

from __future__ import annotations

import contextlib
import json
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from attnlab.errors import UserError
from attnlab.location import Location

STATE_FILE = "state.pt"
META_FILE = "meta.json"


def save_checkpoint(directory: str | Path, *, model, optimizer, step: int, cfg: dict, gpt_config: dict,
                    metrics: dict) -> None:
    """Write a checkpoint into ``directory``; ``step`` is the number of optimizer steps completed."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "data_position": {"next_step": step},  # the sampler is a pure function of (seed, step, rank)
        "rng": {
            "torch": torch.get_rng_state(),
            "cuda": _own_cuda_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        },
        "config": cfg,
        "gpt_config": gpt_config,
    }
    torch.save(state, directory / STATE_FILE)
    meta = {"step": step, "config": cfg, "gpt_config": gpt_config, "metrics": metrics}
    (directory / META_FILE).write_text(json.dumps(meta, indent=1, default=float))


def load_state(directory: str | Path) -> dict:
    """The checkpoint's state, every tensor on the CPU (``load_state_dict`` copies them to the model's device;
    the RNG states must stay CPU ByteTensors, and a GPU need not hold a second copy of the weights)."""
    path = Path(directory) / STATE_FILE
    if not path.exists():
        raise UserError(f"checkpoint {directory} holds no {STATE_FILE}: not an attnlab checkpoint")
    return torch.load(path, map_location="cpu", weights_only=False)


def _own_cuda_rng_state() -> torch.Tensor | None:
    """The CUDA RNG state of this process's current device, or None where CUDA was never initialised (its RNG
    was not used; a CPU run on a GPU machine does not create a CUDA context to save it)."""
    return torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None


def restore_rng(rng: dict) -> None:
    """Restore the saved RNG states. ``torch.set_rng_state`` takes a CPU ByteTensor only, so each saved state
    is moved to the CPU first (a state loaded onto a GPU would otherwise fail every resume there). The CUDA state
    goes to this process's own device, whatever number of GPUs it sees (none: it is skipped)."""
    torch.set_rng_state(rng["torch"].cpu())
    cuda = rng.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if isinstance(cuda, (list, tuple)):  # written before one state per process: every visible device's
            own = torch.cuda.current_device()
            cuda = (cuda[own] if own < len(cuda) else cuda[0]) if len(cuda) else None
        if cuda is not None:
            torch.cuda.set_rng_state(cuda.cpu())
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])


def resume(directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load a checkpoint into ``model`` and ``optimizer`` (on whatever device they live), restore the RNG
    states, and return the number of optimizer steps it had completed."""
    state = load_state(directory)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])  # moves its state to the parameters' device
    restore_rng(state["rng"])
    return int(state["step"])


def _meta_step(loc: Location, name: str) -> int | None:
    try:
        return int(json.loads(loc.read_bytes(f"{name}/{META_FILE}"))["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def find_latest_checkpoint(path: str | Path | Location) -> Location:
    """``path`` itself if it is a checkpoint, else the checkpoint with the highest step inside a run folder
    (local or on object storage): Ray Train's ``checkpoint_*`` folders and plain-process ``checkpoints/step_*``."""
    loc = Location.parse(path, field="checkpoint")
    if not loc.exists():
        raise UserError(f"checkpoint path {loc.uri} does not exist: give a run folder or a checkpoint folder")
    if loc.is_file(STATE_FILE):
        return loc
    stepped = checkpoint_steps(loc)
    if not stepped:
        raise UserError(f"{loc.uri} holds no checkpoint (no checkpoint_*/ or checkpoints/step_*/ with {STATE_FILE})")
    return loc.child(stepped[max(stepped)])


def checkpoint_steps(run: Location) -> dict[int, str]:
    """``{step: folder}`` of the whole checkpoints in a run folder (Ray Train's ``checkpoint_*`` and plain-process
    ``checkpoints/step_*``); empty when it has none, or does not exist."""
    if not run.exists():
        return {}
    candidates = [n for n in run.list_names(hidden=False) if n.startswith("checkpoint_")]
    candidates += [f"checkpoints/{n}" for n in run.list_names("checkpoints", hidden=False) if n.startswith("step_")]
    return {step: name for name in sorted(candidates)
            if (step := _meta_step(run, name)) is not None and run.is_file(f"{name}/{STATE_FILE}")}


def load_weights(run: str | Path | Location, step: int, model: torch.nn.Module, *, field: str = "init_from") -> None:
    """Load the weights of ``run``'s checkpoint at ``step`` into ``model`` (a stage starting from its parent: the
    weights only, no optimiser, RNG or step). UserError, one line, when that checkpoint was not kept."""
    loc = Location.parse(run, field=field)
    stepped = checkpoint_steps(loc)
    if step not in stepped:
        kept = ", ".join(str(s) for s in sorted(stepped)) or "none"
        raise UserError(f"{field}: run {loc.uri} kept no checkpoint at step {step} (its final step; kept: {kept}); "
                        "train the parent again with its final checkpoint kept")
    with local_checkpoint(loc.child(stepped[step])) as directory:
        model.load_state_dict(load_state(directory)["model"])


@contextlib.contextmanager
def local_checkpoint(path: str | Path | Location) -> Iterator[Path]:
    """The latest checkpoint under ``path`` as a local folder (downloaded to a temporary one from object storage)."""
    loc = find_latest_checkpoint(path)
    if loc.is_local:
        yield Path(loc.path)
        return
    with tempfile.TemporaryDirectory(prefix="attnlab-ckpt-") as tmp:
        yield Path(loc.download("", tmp))


def load_model(path: str | Path | Location, device="cpu"):
    """``(model, train_config_dict, meta)`` from a checkpoint or a run folder's latest checkpoint.

    ``meta``: ``{"step", "checkpoint"}`` (the checkpoint's canonical location, a path or a URI). A model whose
    attention is a plugin's runs the plugin's bytes its training config recorded (``plugin``:
    docs/plugins.md#plugins-in-training-and-studies); another version loaded in this process is refused.
    """
    from attnlab.model import build_model, config_from_dict

    loc = find_latest_checkpoint(path)
    with local_checkpoint(loc) as directory:
        state = load_state(directory)
    recorded = (state.get("config") or {}).get("plugin")
    if recorded:
        from attnlab.attention.plugin import PluginSource, load_recorded

        load_recorded(PluginSource.from_dict(recorded), holder=f"checkpoint {loc.uri}")
    model = build_model(config_from_dict(state["gpt_config"])).to(device)
    model.load_state_dict(state["model"])
    model.eval()
    meta = {"step": state["step"], "checkpoint": loc.uri}
    return model, state["config"], meta


def run_of_checkpoint(checkpoint: Location) -> Location:
    """The run folder a checkpoint belongs to (``RUN/checkpoint_*`` or ``RUN/checkpoints/step_*``)."""
    parent = checkpoint.parent
    return parent.parent if parent.name == "checkpoints" else parent
