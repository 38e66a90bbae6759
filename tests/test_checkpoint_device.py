"""Resuming a run whose model lives on a non-CPU device (the CUDA path, checked on CPU with ``meta`` tensors).

A Train worker on a GPU builds its model and optimiser on the GPU, then resumes from a checkpoint. The saved RNG
states are CPU ByteTensors that ``torch.set_rng_state`` only accepts on the CPU; a loader that maps the whole
checkpoint onto the model's device broke every resume on a GPU (every Ray Train restart after a worker failure,
every resumed study). ``meta`` stands for the GPU here: a tensor placed on it is not on the CPU, as on CUDA.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from attnlab.model import build_model, preset
from attnlab.model.checkpoint import load_state, resume, save_checkpoint
from attnlab.train.config import TrainConfig
from attnlab.train.recipe import build_optimizer

pytestmark = pytest.mark.cuda_proxy


def _trained(tmp_path):
    torch.manual_seed(0)
    cfg = preset("tiny", vocab_size=64, n_layer=1)
    model = build_model(cfg)
    optimizer = build_optimizer(model, TrainConfig(preset="tiny", data={"synthetic": "copy_distractors"}),
                                torch.device("cpu"))
    x = torch.randint(0, 64, (2, 16))
    _, loss = model(x, x)
    loss.backward()
    optimizer.step()
    torch.manual_seed(1234)
    np.random.seed(5)
    random.seed(6)
    save_checkpoint(tmp_path, model=model, optimizer=optimizer, step=7, cfg={}, gpt_config={}, metrics={})
    expected = (torch.rand(3), np.random.rand(), random.random())
    return cfg, expected


def test_resume_onto_a_non_cpu_device_restores_weights_optimiser_and_rng(tmp_path):
    cfg, (torch_next, numpy_next, python_next) = _trained(tmp_path)
    torch.manual_seed(99), np.random.seed(99), random.seed(99)  # noqa: B018 - scramble every generator

    with torch.device("meta"):  # built on the device, as a GPU worker's model is moved there before resuming
        model = build_model(cfg)
    optimizer = build_optimizer(model, TrainConfig(preset="tiny", data={"synthetic": "copy_distractors"}),
                                torch.device("meta"))
    step = resume(tmp_path, model, optimizer)

    assert step == 7
    assert all(p.device.type == "meta" for p in model.parameters())
    moments = [s["exp_avg"] for s in optimizer.state.values()]
    assert moments and all(m.device.type == "meta" for m in moments)  # the optimiser state follows its params
    assert torch.equal(torch.rand(3), torch_next)
    assert np.random.rand() == numpy_next and random.random() == python_next


def test_loaded_state_keeps_every_tensor_on_the_cpu(tmp_path):
    _trained(tmp_path)
    state = load_state(tmp_path)
    assert state["rng"]["torch"].device.type == "cpu" and state["rng"]["torch"].dtype == torch.uint8
    assert all(t.device.type == "cpu" for t in state["model"].values())
