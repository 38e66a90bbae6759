"""Checkpoints: what one holds (model, optimiser, step, data position, RNG states, config) and how to find
the latest one in a run folder. Both Ray Train's ``checkpoint_*`` folders and plain-process
``checkpoints/step_*`` folders are understood. No Ray here.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

from attnlab.errors import UserError

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
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        },
        "config": cfg,
        "gpt_config": gpt_config,
    }
    torch.save(state, directory / STATE_FILE)
    meta = {"step": step, "config": cfg, "gpt_config": gpt_config, "metrics": metrics}
    (directory / META_FILE).write_text(json.dumps(meta, indent=1, default=float))


def load_state(directory: str | Path, map_location="cpu") -> dict:
    path = Path(directory) / STATE_FILE
    if not path.exists():
        raise UserError(f"checkpoint {directory} holds no {STATE_FILE}: not an attnlab checkpoint")
    return torch.load(path, map_location=map_location, weights_only=False)


def restore_rng(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])


def checkpoint_step(directory: Path) -> int | None:
    try:
        return int(json.loads((directory / META_FILE).read_text())["step"])
    except (OSError, ValueError, KeyError):
        return None


def find_latest_checkpoint(path: str | Path) -> Path:
    """``path`` itself if it is a checkpoint, else the checkpoint with the highest step inside a run folder."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"checkpoint path {path} does not exist: give a run folder or a checkpoint folder")
    if (path / STATE_FILE).exists():
        return path
    candidates = [d for d in [*path.glob("checkpoint_*"), *path.glob("checkpoints/step_*")] if d.is_dir()]
    stepped = [(s, d) for d in candidates if (s := checkpoint_step(d)) is not None and (d / STATE_FILE).exists()]
    if not stepped:
        raise UserError(f"{path} holds no checkpoint (no checkpoint_*/ or checkpoints/step_*/ with {STATE_FILE})")
    return max(stepped, key=lambda item: (item[0], item[1].name))[1]


def load_model(path: str | Path, device="cpu"):
    """``(model, train_config_dict, meta)`` from a checkpoint or a run folder's latest checkpoint."""
    from attnlab.model import GPT, GPTConfig

    directory = find_latest_checkpoint(path)
    state = load_state(directory, map_location=device)
    model = GPT(GPTConfig(**state["gpt_config"])).to(device)
    model.load_state_dict(state["model"])
    model.eval()
    meta = {"step": state["step"], "checkpoint": str(directory)}
    return model, state["config"], meta
