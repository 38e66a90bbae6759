"""Resuming a run whose model lives on a non-CPU device (the CUDA path, checked on CPU with ``meta`` tensors), and
the CUDA RNG state across GPU counts (torch's own CUDA RNG functions over a stubbed device table).

A Train worker on a GPU builds its model and optimiser on the GPU, then resumes from a checkpoint. The saved RNG
states are CPU ByteTensors that ``torch.set_rng_state`` only accepts on the CPU; a loader that maps the whole
checkpoint onto the model's device broke every resume on a GPU (every Ray Train restart after a worker failure,
every resumed study). ``meta`` stands for the GPU here: a tensor placed on it is not on the CPU, as on CUDA.

Ray Train shares ``CUDA_VISIBLE_DEVICES`` across a node's workers: rank 0 on an 8-GPU node saw 8 GPUs, saved 8
CUDA states, and ``set_rng_state_all`` failed (``IndexError: tuple index out of range``) in a process seeing fewer.
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


# --- the CUDA RNG state across GPU counts -----------------------------------------------------------------------

def _visible_gpus(monkeypatch, count: int, current: int = 0) -> tuple[torch.Generator, ...]:
    """This process sees ``count`` GPUs, its current device being ``current``: torch.cuda's device table stubbed at
    its narrowest point (the device count and current device ``torch._C`` reports, CUDA initialised, the per-device
    default generators), so torch's own ``is_available``, ``get_rng_state``, ``set_rng_state`` and
    ``get_rng_state_all`` run unchanged. CPU generators stand for the devices' (a state is a ByteTensor either way)."""
    generators = tuple(torch.Generator().manual_seed(100 + i) for i in range(count))
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: count, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: current, raising=False)
    monkeypatch.setattr(torch.cuda, "_initialized", count > 0)
    monkeypatch.setattr(torch.cuda, "_cached_device_count", None)
    monkeypatch.setattr(torch.cuda, "default_generators", generators)
    return generators


def _draws(generator: torch.Generator) -> torch.Tensor:
    return torch.rand(4, generator=generator)


def _save(tmp_path, monkeypatch, count: int, current: int) -> torch.Tensor | None:
    """A checkpoint saved by a rank on GPU ``current`` of ``count`` visible ones; its device's next draws."""
    generators = _visible_gpus(monkeypatch, count, current)
    for g in generators:
        _draws(g)  # every device's stream has moved on
    model = build_model(preset("tiny", vocab_size=64, n_layer=1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    save_checkpoint(tmp_path, model=model, optimizer=optimizer, step=3, cfg={}, gpt_config={}, metrics={})
    return _draws(torch.Generator().set_state(generators[current].get_state())) if generators else None


def _resume(tmp_path):
    model = build_model(preset("tiny", vocab_size=64, n_layer=1))
    return resume(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_the_checkpoint_holds_its_own_devices_cuda_state(tmp_path, monkeypatch):
    expected = _save(tmp_path, monkeypatch, count=8, current=5)  # rank 5's process on an 8-GPU node
    state = load_state(tmp_path)["rng"]["cuda"]
    assert isinstance(state, torch.Tensor) and torch.equal(_draws(torch.Generator().set_state(state)), expected)


@pytest.mark.parametrize("visible", [1, 0])
def test_a_rank_resumes_its_cuda_stream_where_fewer_gpus_are_visible(tmp_path, monkeypatch, visible):
    expected = _save(tmp_path, monkeypatch, count=8, current=5)
    generators = _visible_gpus(monkeypatch, visible)
    assert _resume(tmp_path) == 3  # today: IndexError: tuple index out of range (set_rng_state_all of 8 states)
    if visible:
        assert torch.equal(_draws(generators[0]), expected)  # device 0 continues the stream GPU 5 saved


@pytest.mark.parametrize("visible", [1, 0])
def test_an_old_checkpoint_with_every_visible_devices_state_still_loads(tmp_path, monkeypatch, visible):
    # Written before: rank 0 on an 8-GPU node saved torch.cuda.get_rng_state_all() (8 states, its own first).
    _save(tmp_path, monkeypatch, count=0, current=0)  # no CUDA state; the old list is put in below
    generators = _visible_gpus(monkeypatch, 8, current=0)
    for i, g in enumerate(generators):
        for _ in range(i + 1):
            _draws(g)
    path = tmp_path / "state.pt"
    state = torch.load(path, weights_only=False)
    state["rng"]["cuda"] = torch.cuda.get_rng_state_all()
    assert len(state["rng"]["cuda"]) == 8
    torch.save(state, path)
    expected = _draws(torch.Generator().set_state(generators[0].get_state()))  # rank 0's own device

    fresh = _visible_gpus(monkeypatch, visible)
    assert _resume(tmp_path) == 3
    if visible:
        assert torch.equal(_draws(fresh[0]), expected)
