"""The GPU memory plan (attnlab.model.memory, docs/gpu-memory.md): the estimate against peaks measured on CPU
with torch's MemTracker, its shape, the refusal of ``study validate --cluster`` for a study that does not fit
its GPU type, ``micro_batch: auto``, and every shipped study against the cluster files it is meant for."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from attnlab.cluster import fit as cf
from attnlab.cluster import validate as cv
from attnlab.errors import UserError
from attnlab.model import GPT, preset
from attnlab.model.memory import (estimate_eval, estimate_train_step, largest_eval_batch, largest_micro_batch,
                                  num_params)
from attnlab.study.fit import check_study_memory
from attnlab.train.config import CPU_AUTO_MICRO_BATCH, load_train_config

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster"
STUDIES = sorted((ROOT / "studies").glob("*.yaml"))
GIB = 1024**3
# The estimate's stated tolerance against the CPU measurement (docs/gpu-memory.md#error-against-cpu-measurements).
TRAIN_TOLERANCE = 0.05


def _measured_train_peak(cfg, seq_len: int, micro_batch: int, precision: str = "fp32") -> int:
    """Peak bytes of live CPU tensors over two optimizer steps of two micro-steps each (the second step has
    AdamW's state and, in its second micro-step, live grads), as the training loop runs them; ``bf16``: under
    CPU autocast (linear layers in bf16, LayerNorm and the loss in fp32, as CUDA's autocast)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len))
    y = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len))
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            for _ in range(2):
                tracker.reset_mod_stats()  # per-module stats only; the device peak is kept
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                    _, loss = model(x, y)  # the loop holds the logits like this through the backward
                (loss / 2).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


WIDE = dict(preset="tiny", n_layer=2, n_head=4, n_embd=256, vocab_size=256)  # activations over the loss path


@pytest.mark.cuda_proxy
@pytest.mark.parametrize("model, seq_len, micro_batch, backend, precision", [
    (dict(preset="tiny"), 64, 8, "dense", "fp32"),
    (dict(preset="tiny"), 256, 4, "dense", "fp32"),
    (dict(preset="tiny", attention="lssa", p_train=15), 256, 2, "dense", "fp32"),
    (dict(preset="tiny-4l", attention="sigmoid_l1"), 128, 4, "dense", "fp32"),
    (dict(preset="tiny", attn_impl="sdpa"), 128, 8, "sdpa", "fp32"),
    (WIDE, 128, 4, "dense", "bf16"),
    (dict(WIDE, attn_impl="sdpa"), 128, 4, "sdpa", "bf16"),
], ids=["softmax-64x8", "softmax-256x4", "lssar-256x2", "sigmoid_l1-4l-128x4", "sdpa-128x8", "wide-bf16-128x4",
        "wide-bf16-sdpa-128x4"])
def test_train_estimate_matches_the_cpu_measurement(model, seq_len, micro_batch, backend, precision):
    model = {"vocab_size": 2048, **model}
    cfg = preset(model.pop("preset"), **model)
    measured = _measured_train_peak(cfg, seq_len, micro_batch, precision)
    est = estimate_train_step(cfg, seq_len, micro_batch, precision=precision, compiled=False, backend=backend)
    print(f"train {cfg.attention} {backend} {precision} T={seq_len} B={micro_batch}: measured {measured:,} B, estimate "
          f"{est.tensor_bytes:,} B ({est.tensor_bytes / measured - 1:+.1%})")
    assert abs(est.tensor_bytes / measured - 1) <= TRAIN_TOLERANCE, (est.tensor_bytes, measured, est.breakdown)
    assert est.total > est.tensor_bytes == sum(est.breakdown.values())


@pytest.mark.cuda_proxy
@pytest.mark.parametrize("model, length, batch, low, high", [
    (dict(), 256, 4, -0.05, 0.05),  # the LM head's chunk is the peak
    (dict(), 1024, 1, -0.05, 0.05),  # the dense attention's chunk is the peak
    (dict(attention="lssa", p_train=15), 1024, 2, 0.0, 0.35),  # sharpening's temporaries: an upper bound
])
def test_eval_estimate_matches_the_cpu_measurement(model, length, batch, low, high):
    from torch.distributed._tools.mem_tracker import MemTracker

    cfg = preset("tiny", vocab_size=2048, **model)
    net = GPT(cfg).eval()
    x = torch.randint(0, cfg.vocab_size, (batch, length))
    tracker = MemTracker()
    tracker.track_external(net)
    with tracker, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net.token_stats(x, x)
    measured = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    est = estimate_eval(cfg, length, batch, precision="fp32", backend="dense")
    print(f"eval {cfg.attention} L={length} B={batch}: measured {measured:,} B, estimate {est.tensor_bytes:,} B "
          f"({est.tensor_bytes / measured - 1:+.1%})")
    assert low <= est.tensor_bytes / measured - 1 <= high, (est.tensor_bytes, measured, est.breakdown)


@pytest.mark.cuda_proxy
def test_estimates_grow_with_micro_batch_and_length_and_count_parameters():
    cfg = preset("gpt2-small")
    assert num_params(cfg) == 123_653_376  # GPT-2 124M less its 0.8M position table (RoPE)
    for backend in ("sdpa", "dense"):
        by_batch = [estimate_train_step(cfg, 1024, b, backend=backend).total for b in (1, 2, 8, 32)]
        by_length = [estimate_train_step(cfg, t, 4, backend=backend).total for t in (256, 512, 1024, 2048)]
        assert by_batch == sorted(set(by_batch)) and by_length == sorted(set(by_length))
        evals = [estimate_eval(cfg, t, 1, backend=backend).total for t in (1024, 4096, 16384)]
        assert evals == sorted(set(evals))
    # O(T^2): the dense path's activations grow faster than the fused path's
    ratio = {b: estimate_train_step(cfg, 2048, 4, backend=b).breakdown["activations"]
             / estimate_train_step(cfg, 1024, 4, backend=b).breakdown["activations"] for b in ("sdpa", "dense")}
    assert ratio["sdpa"] == pytest.approx(2.0, rel=0.01) and ratio["dense"] > 2.5
    # compile and bf16 save memory; a second worker adds DDP's buckets
    base = estimate_train_step(cfg, 1024, 16)
    assert estimate_train_step(cfg, 1024, 16, compiled=False).total > base.total
    assert estimate_train_step(cfg, 1024, 16, precision="fp32").total > base.total
    assert estimate_train_step(cfg, 1024, 16, ddp=True).tensor_bytes == base.tensor_bytes + 4 * num_params(cfg)
    with pytest.raises(ValueError, match="precision='fp16' is not allowed"):
        estimate_train_step(cfg, 1024, 16, precision="fp16")
    with pytest.raises(ValueError, match="micro_batch=0 is not allowed"):
        estimate_train_step(cfg, 1024, 0)


@pytest.mark.cuda_proxy
def test_largest_micro_batch_is_the_last_that_fits():
    cfg = preset("gpt2-small")
    budget = 40960 * 1024**2
    best = largest_micro_batch(cfg, 1024, budget, ddp=True, divisor_of=64)
    assert 64 % best == 0 and 1 <= best < 64
    assert estimate_train_step(cfg, 1024, best, ddp=True).total <= budget
    assert estimate_train_step(cfg, 1024, 2 * best, ddp=True).total > budget
    assert largest_micro_batch(cfg, 1024, 10**8) == 0  # 100 MB: not even one sequence
    fits = largest_eval_batch(cfg, 16384, budget)
    assert estimate_eval(cfg, 16384, fits).total <= budget < estimate_eval(cfg, 16384, fits + 1).total


def test_gpu_types_come_from_one_table():
    request = {"workers": 8, "gpus_per_worker": 1, "cpus_per_worker": 8}
    aws, gcp = cf.trial_gpu(request, CLUSTER / "aws.yaml"), cf.trial_gpu(request, CLUSTER / "gcp.yaml")
    assert (aws.gpu_type, gcp.gpu_type) == ("A100-40GB", "A100-80GB")
    assert aws.memory_bytes == cv.GPU_MEMORY["A100-40GB"] and "p4d.24xlarge" in aws.note
    assert cf.trial_gpu({"workers": 1}, CLUSTER / "aws.yaml") is None  # a CPU trial
    assert [cv.gpu_of_machine(m) for m in ("p4de.24xlarge", "p5.48xlarge", "a2-highgpu-8g", "a3-highgpu-8g",
                                           "nvidia-a100-80gb", "m6i.2xlarge")] == \
        ["A100-80GB", "H100-80GB", "A100-40GB", "H100-80GB", "A100-80GB", None]
    gpu_machines = [m for table in cv.INSTANCE_TYPES.values() for m, r in table.items() if r["GPU"]]
    assert all(cv.gpu_of_machine(m) in cv.GPU_MEMORY for m in gpu_machines), gpu_machines


def test_kuberay_gpu_type_is_read_from_the_node_selector_or_skipped(tmp_path):
    request = {"workers": 8, "gpus_per_worker": 1, "cpus_per_worker": 8}
    shipped = cf.trial_gpu(request, CLUSTER / "kuberay" / "raycluster.yaml")
    assert shipped.gpu_type is None and "GPU type unknown" in shipped.note and "check skipped" in shipped.note
    text = (CLUSTER / "kuberay" / "raycluster.yaml").read_text()
    old = "          # nodeSelector: {cloud.google.com/gke-accelerator: nvidia-a100-80gb}"
    assert old in text
    pinned = tmp_path / "raycluster.yaml"
    pinned.write_text(text.replace(old, old.replace("# ", "", 1)))
    assert cf.trial_gpu(request, pinned).gpu_type == "A100-80GB"


def _study(tmp_path: Path, train: str, eval_: str = "{multiples: [1, 16]}") -> Path:
    path = tmp_path / "big.yaml"
    path.write_text(f"name: big\ntrain: {{preset: gpt2-small, data: data/fineweb, seq_len: 1024, "
                    f"tokens_per_step: 524288, workers: 8, gpus_per_worker: 1, cpus_per_worker: 8, {train}}}\n"
                    f"resources: {{max_concurrent_trials: 1, trial_cpus: 1}}\neval: {eval_}\n")
    return path


def test_study_validate_refuses_a_step_that_does_not_fit_and_accepts_one_that_does(tmp_path, capsys):
    from attnlab.cli import main

    aws = str(CLUSTER / "aws.yaml")
    assert main(["study", "validate", str(_study(tmp_path, "micro_batch: 64")), "--cluster", aws]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("attnlab: error:")]
    assert len(err) == 1, err
    assert ("study 'big'" in err[0] and "A100-40GB" in err[0] and "GiB per GPU" in err[0]
            and "largest micro_batch that fits (and divides the step's sequences) is 32" in err[0]), err[0]
    for ok in ("micro_batch: 32", "micro_batch: auto"):
        assert main(["study", "validate", str(_study(tmp_path, ok)), "--cluster", aws]) == 0
        assert "GPU memory on A100-40GB" in capsys.readouterr().out
    # 64 fits an 80 GB A100 (gcp.yaml's a2-ultragpu-8g)
    assert main(["study", "validate", str(_study(tmp_path, "micro_batch: 64")), "--cluster",
                 str(CLUSTER / "gcp.yaml")]) == 0
    capsys.readouterr()
    # evaluation: 128 windows of 1,024 tokens per forward do not fit a 40 GB GPU; the line names the eval batch
    big_eval = _study(tmp_path, "micro_batch: auto", "{multiples: [1, 16], batch_size: 128}")
    assert main(["study", "validate", str(big_eval), "--cluster", aws]) == 2
    err = capsys.readouterr().err
    assert "evaluating attention softmax at 1,024 tokens (eval batch 128)" in err and "eval.batch_size:" in err, err


def test_micro_batch_auto_keeps_tokens_per_step():
    cfg = load_train_config({"micro_batch": "auto", "workers": 8, "gpus_per_worker": 1})
    forty, eighty = cv.GPU_MEMORY["A100-40GB"], cv.GPU_MEMORY["A100-80GB"]
    for budget, expected in ((forty, 32), (eighty, 64)):
        resolved = cfg.resolved(8, budget)
        assert resolved.micro_batch == expected
        global_batch, accum = resolved.batch_plan(8)
        assert global_batch * cfg.seq_length == cfg.tokens_per_step == 524_288
        assert accum * expected * 8 == global_batch
        assert resolved.train_key("d") == cfg.train_key("d")  # a run setting, not the run's identity
    # no GPU here: the documented CPU default, a divisor of the sequences per worker
    assert cfg.resolved(8).micro_batch == CPU_AUTO_MICRO_BATCH
    assert load_train_config({"preset": "tiny", "micro_batch": "auto", "tokens_per_step": 768,
                              "seq_len": 64}).resolved().micro_batch == 12
    assert "micro-batch auto (here 16)" in cfg.plan(8)
    assert load_train_config({"preset": "gpt2-medium"}).micro_batch == "auto"
    with pytest.raises(UserError, match="not even 1 sequence"):
        cfg.resolved(8, 2 * GIB)


def test_micro_batch_auto_sizes_a_shared_gpu_by_its_fraction():
    # Half an 80 GB GPU per worker (two trials on one GPU): auto picks what fits 40 GB, not the whole GPU's 64.
    half = load_train_config({"micro_batch": "auto", "workers": 1, "gpus_per_worker": 0.5})
    whole = load_train_config({"micro_batch": "auto", "workers": 1, "gpus_per_worker": 1})
    eighty = cv.GPU_MEMORY["A100-80GB"]
    assert whole.resolved(1, eighty).micro_batch == 64
    assert half.resolved(1, eighty).micro_batch == whole.resolved(1, eighty // 2).micro_batch == 32


@pytest.mark.parametrize("gpus", [0.5, 0.25])
def test_a_fraction_of_a_gpu_per_rank_is_refused_with_more_than_one_worker(gpus):
    with pytest.raises(UserError) as info:
        load_train_config({"workers": 2, "gpus_per_worker": gpus})
    message = str(info.value)
    assert "\n" not in message and f"gpus_per_worker={gpus:g} with workers=2 is not allowed" in message
    assert "NCCL" in message and "gpus_per_worker: 1" in message
    assert load_train_config({"workers": 1, "gpus_per_worker": gpus}).gpus_per_worker == gpus  # one rank: fine
    assert load_train_config({"workers": 2, "gpus_per_worker": 0}).workers == 2  # CPU workers: fine


@pytest.mark.parametrize("value", [0, "big", -4, True, 2.5])
def test_bad_micro_batch_values_are_refused_in_one_line(value, tmp_path):
    with pytest.raises(UserError) as info:
        load_train_config({"micro_batch": value})
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"train.micro_batch={value!r}")
    assert "positive integer or auto" in message
    from attnlab.study.spec import load_spec

    study = tmp_path / "s.yaml"
    study.write_text(f"name: s\ntrain: {{preset: tiny, data: demo, micro_batch: {value!r}}}\n")
    with pytest.raises(UserError, match="micro_batch"):
        load_spec(study)


@pytest.mark.parametrize("config", [CLUSTER / "aws.yaml", CLUSTER / "gcp.yaml"], ids=lambda p: p.name)
def test_every_shipped_study_fits_the_gpu_of_its_cluster_files(config):
    """Every study against the default GPU node type of the cloud configs (p4d = A100 40 GB on AWS, A100 80 GB
    on GCP); the KubeRay manifest names no GPU type, so its check is skipped (the other test above)."""
    from attnlab.study.spec import load_spec

    checked = []
    for study in STUDIES:
        spec = load_spec(study)
        note = check_study_memory(spec, str(config))
        gpu = spec.train.gpus_per_worker > 0
        assert note.startswith("GPU memory on " if gpu else "GPU memory: CPU workers"), (study.name, note)
        checked += [study.name] if gpu else []
    assert {"paper_table4.yaml", "p_sweep.yaml"} <= set(checked)
