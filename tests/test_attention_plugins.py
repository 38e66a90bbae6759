"""Attention plugins (attention/plugin.py, docs/plugins.md): the contract, loading a file or a module and loading it
again from its bytes alone in another process, bad plugins in one line, ``attnlab attention check`` on the shipped
plugins (FoX, stick-breaking, Scalable-Softmax) and on broken ones, and the shipped plugins against their formulas."""

from __future__ import annotations

import contextlib
import io
import math
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attnlab.attention import (Backend, attend, attention_weights, get_variant, load_plugin, resolve_backend,
                               variant_names)
from attnlab.attention.plugin import (PluginError, PluginSource, Shape, Variant, build_params, prepare_state,
                                      read_source, reference_weights, unload_plugin)
from attnlab.cli import main

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = ROOT / "plugins"
SHIPPED = ("fox", "stickbreaking", "ssmax")

SOFTMAX_REFERENCE = '''
import math, torch
from attnlab.attention.plugin import Variant

def reference(q, k, rows, ctx):
    s = q @ k.transpose(-1, -2) / math.sqrt(ctx.head_dim) + ctx.alibi(rows.h, rows.i, rows.j)
    return torch.softmax(s.masked_fill(~rows.visible, float("-inf")), dim=-1)
'''


@pytest.fixture
def plugins():
    """Load plugins for one test; forget them afterwards (names stay free for the next test)."""
    loaded = []

    def load(ref):
        plugin = load_plugin(str(ref))
        loaded.append(plugin)
        return plugin

    yield load
    for plugin in loaded:
        unload_plugin(plugin)


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def _qkv(T=23, B=2, H=2, D=16, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=gen, dtype=dtype) for _ in range(3)]


def _state(spec, T=23, B=2, H=2, D=16, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    shape = Shape(H * D, H, D)
    params = build_params(spec, shape)
    params = params.to(dtype) if params is not None else None
    x = torch.randn(B, T, H * D, generator=torch.Generator().manual_seed(seed + 1), dtype=dtype)
    return prepare_state(spec, x, params, shape)


# --- the contract ---------------------------------------------------------------------------------------------

def _reference(q, k, rows, ctx):
    return torch.softmax((q @ k.transpose(-1, -2)).masked_fill(~rows.visible, float("-inf")), dim=-1)


@pytest.mark.parametrize("fields, message", [
    (dict(name="x", reference=_reference, scale=2.0),
     "Variant field 'scale' is unknown: use name, source, reference, log_score, fused, params, prepare, normalised, "
     "saved_bytes"),
    (dict(name="x"), "variant 'x' has no reference form: give reference=f(q, k, rows, ctx) -> weights"),
    (dict(name="x", reference=_reference, log_score=lambda *a: a[0], fused=lambda *a: a[2]),
     "variant 'x' gives both log_score and fused: give one fused form"),
    (dict(name="two words", reference=_reference), "Variant name='two words' is not allowed"),
    (dict(reference=_reference), "Variant name=None is not allowed"),
    (dict(name="x", reference=_reference, normalised="yes"), "normalised='yes' is not allowed: use True or False"),
])
def test_a_variant_takes_known_keyword_fields_only(fields, message):
    with pytest.raises(PluginError) as info:
        Variant(**fields)
    assert message in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(TypeError):
        Variant("x", _reference)  # keyword fields only


def test_a_plugin_variant_is_a_spec_the_platform_accepts(plugins, monkeypatch):
    from attnlab.attention import flex
    from attnlab.model import GPTConfig

    monkeypatch.setattr(flex, "_warned_fallback", set())
    plugins(PLUGINS / "fox.py")
    plugins(PLUGINS / "stickbreaking.py")
    assert {"fox", "stickbreaking"} <= set(variant_names())
    fox = get_variant("fox", p=3, position_bias="alibi")
    assert (fox.name, fox.p, fox.sharpened, fox.position_bias, fox.scale_label) == ("fox", 3.0, True, "alibi", "plugin")
    assert fox.replace(p=None) == get_variant("fox", position_bias="alibi") and not fox.learned_qk_gain
    with pytest.raises(ValueError, match="attention override 'scale' does not apply to plugin variant 'fox'"):
        get_variant("fox", scale="log_n")
    with pytest.raises(ValueError, match="impl='sdpa' cannot compute attention 'fox' exactly: a plugin variant"):
        resolve_backend(get_variant("fox"), "cpu", "sdpa")
    with pytest.raises(ValueError, match="model.attn_impl='sdpa' cannot compute attention 'fox'"):
        GPTConfig(attention="fox", attn_impl="sdpa")
    # on CUDA: the fused form, sharpened too (the two passes over its log_score); a reference-only variant runs its
    # reference after one warning
    assert resolve_backend(get_variant("fox"), "cuda") is Backend.FLEX
    assert resolve_backend(fox, "cuda") is Backend.FLEX
    with pytest.warns(UserWarning, match=r"'stickbreaking' has no fused form \(the plugin gives a reference form "
                                         r"only\): using the dense reference"):
        assert resolve_backend(get_variant("stickbreaking"), "cuda") is Backend.DENSE
    spec = get_variant("fox")
    assert pickle.loads(pickle.dumps(spec)) == spec  # a spec ships as its plugin's bytes and its name


def test_a_state_is_needed_exactly_where_the_variant_has_one(plugins):
    plugins(PLUGINS / "fox.py")
    plugins(PLUGINS / "stickbreaking.py")
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="attention 'fox' needs its layer's state"):
        attend(q, k, v, get_variant("fox"))
    with pytest.raises(ValueError, match="qk_gain is given but attention 'fox' is a plugin variant"):
        attend(q, k, v, get_variant("fox"), qk_gain=(torch.ones(16), torch.ones(16)))
    with pytest.raises(ValueError, match="state is given but attention 'softmax' is not a plugin variant"):
        attend(q, k, v, get_variant("softmax"), state=_state(get_variant("fox")))
    assert attend(q, k, v, get_variant("stickbreaking")).shape == q.shape  # no params, no prepare: no state needed


def test_a_non_normalised_variant_refuses_sharpening_in_one_line(tmp_path, plugins):
    path = _write(tmp_path / "unnormalised.py", SOFTMAX_REFERENCE + 'VARIANTS = [Variant(name="plain", '
                                                                   'reference=reference)]\n')
    plugins(path)
    with pytest.raises(ValueError, match="p=3 is not allowed for attention 'plain': sharpening needs normalised rows"):
        get_variant("plain", p=3)


# --- loading: a file, a module, the bytes alone ------------------------------------------------------------------

BAD = {
    "syntax": ("import torch\ndef reference(q, k, rows, ctx)\n    return q\n", ":2: SyntaxError: expected ':'"),
    "imports": ("import torch\nimport not_a_module_anywhere\n",
                ":2: ModuleNotFoundError: No module named 'not_a_module_anywhere'"),
    "unknown_field": (SOFTMAX_REFERENCE + "VARIANTS = [Variant(name='u', reference=reference, scale=2)]\n",
                      ":8: Variant field 'scale' is unknown: use name, source, reference"),
    "no_reference": (SOFTMAX_REFERENCE + "VARIANTS = [Variant(name='n', log_score=lambda s, b, h, i, j, c: s)]\n",
                     ":8: variant 'n' has no reference form"),
    "builtin_name": (SOFTMAX_REFERENCE + "VARIANTS = [Variant(name='lssar', reference=reference)]\n",
                     ": variant 'lssar' collides with the built-in variant 'lssar'"),
    "no_variants": (SOFTMAX_REFERENCE, " defines no VARIANTS: add VARIANTS = [Variant("),
    "twice": (SOFTMAX_REFERENCE + "VARIANTS = [Variant(name='t', reference=reference)] * 2\n",
              " defines variant 't' twice"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_plugin_is_one_line_and_nothing_else(case, tmp_path, capsys):
    text, fragment = BAD[case]
    path = _write(tmp_path / f"{case}.py", text)
    assert main(["attention", "check", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, (out, err)
    assert err.startswith(f"attnlab: error: plugin {path}") and fragment in err, err


@pytest.mark.parametrize("ref, fragment", [
    ("missing.py", "plugin file {tmp}/missing.py does not exist: give a path to a .py file or an importable module"),
    ("no_such_module_anywhere", "plugin module 'no_such_module_anywhere' cannot be imported (no module named "
                                "'no_such_module_anywhere' on sys.path)"),
])
def test_a_missing_plugin_is_one_line(ref, fragment, tmp_path, capsys):
    ref = str(tmp_path / ref) if ref.endswith(".py") else ref
    assert main(["attention", "check", ref]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and fragment.format(tmp=tmp_path) in err, err


def test_two_plugins_with_one_name_collide_naming_both(tmp_path, plugins):
    text = SOFTMAX_REFERENCE + "VARIANTS = [Variant(name='same', reference=reference)]\n"
    first = plugins(_write(tmp_path / "a" / "first.py", text))
    with pytest.raises(PluginError, match=rf"plugin {tmp_path}/b/second.py: variant 'same' collides with 'same' "
                                          rf"loaded from {tmp_path}/a/first.py"):
        plugins(_write(tmp_path / "b" / "second.py", text + "# edited\n"))
    assert plugins(tmp_path / "a" / "first.py") is first  # the same source again: nothing new


def test_a_module_plugin_is_its_package_read_without_importing_it(tmp_path, plugins, monkeypatch):
    _write(tmp_path / "mylab" / "__init__.py", "")
    _write(tmp_path / "mylab" / "helpers.py", "TEMPERATURE = 2.0\n")
    _write(tmp_path / "mylab" / "attn.py", SOFTMAX_REFERENCE.replace("ctx.head_dim)", "ctx.head_dim) / TEMPERATURE")
           + "from mylab.helpers import TEMPERATURE\n"
           + "VARIANTS = [Variant(name='cooled', reference=reference)]\n")
    _write(tmp_path / "mylab" / "__pycache__" / "junk.py", "not part of it")
    monkeypatch.syspath_prepend(str(tmp_path))
    source = read_source("mylab.attn")
    assert "mylab" not in sys.modules  # found, not imported
    assert (source.kind, source.entry) == ("module", "mylab.attn")
    assert sorted(source.files) == ["mylab/__init__.py", "mylab/attn.py", "mylab/helpers.py"]
    plugins("mylab.attn:cooled")
    q, k, v = _qkv()
    want = attend(q / 2.0, k, v, get_variant("softmax"))
    assert torch.allclose(attend(q, k, v, get_variant("cooled")), want, atol=1e-12)
    _write(tmp_path / "mylab" / "helpers.py", "TEMPERATURE = 3.0\n")  # editing any file changes the hash
    assert read_source("mylab.attn").sha256 != source.sha256
    with pytest.raises(PluginError, match="plugin module 'mylab.nothing' cannot be imported"):
        read_source("mylab.nothing")
    with pytest.raises(PluginError, match="package 'mylab' is already loaded from other source"):
        plugins("mylab.attn")  # one process runs one version of a package
    with pytest.raises(PluginError, match=r"plugin \S+/fox.py has no variant 'other': it defines fox"):
        plugins(f"{PLUGINS}/fox.py:other")


ELSEWHERE = """
import pickle, sys
from pathlib import Path
import torch
from attnlab.attention import attend, variant_names
from attnlab.attention.plugin import Shape, build_params, prepare_state

spec, source, q, k, v, x, state_dict = pickle.loads(Path(sys.argv[1]).read_bytes())
assert not Path(source.origin).exists() and not any(Path(p).exists() for p in source.files)
assert spec.name in variant_names()  # unpickling the spec loaded its plugin from the bytes
shape = Shape(x.shape[-1], q.shape[1], q.shape[-1])
params = build_params(spec, shape)
if params is not None:
    params.load_state_dict(state_dict)
    params.double()
out = attend(q, k, v, spec, impl="dense", state=prepare_state(spec, x, params, shape))
torch.save(out, sys.argv[2])
"""


@pytest.mark.parametrize("kind", ["file", "module"])
def test_a_plugin_loads_again_from_its_bytes_where_its_files_are_not(kind, tmp_path, plugins, monkeypatch):
    """The PluginSource (its bytes) is all another process needs: the files are deleted, the other process has
    neither them nor their folder on its path, and computes the same output."""
    fox = (PLUGINS / "fox.py").read_text().replace('name="fox"', 'name="fox_elsewhere"')
    if kind == "file":
        ref = str(_write(tmp_path / "plugin" / "fox_elsewhere.py", fox))
    else:
        _write(tmp_path / "plugin" / "fxpkg" / "__init__.py", "from fxpkg.gate import VARIANTS\n")
        _write(tmp_path / "plugin" / "fxpkg" / "gate.py", fox)
        monkeypatch.syspath_prepend(str(tmp_path / "plugin"))
        ref = "fxpkg"
    loaded = plugins(ref)
    spec = get_variant("fox_elsewhere")
    T = 19
    q, k, v = _qkv(T)
    x = torch.randn(2, T, 32, dtype=torch.float64)
    torch.manual_seed(3)
    params = build_params(spec, Shape(32, 2, 16)).double()
    want = attend(q, k, v, spec, impl="dense", state=prepare_state(spec, x, params, Shape(32, 2, 16)))
    payload = tmp_path / "payload.pkl"
    payload.write_bytes(pickle.dumps((spec, loaded.source, q, k, v, x, params.state_dict())))
    for path in sorted((tmp_path / "plugin").rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    env = {"PYTHONPATH": str(ROOT / "platform"), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", ELSEWHERE, str(payload), str(tmp_path / "out.pt")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # another process, started with a bare environment: its thread count (OMP_NUM_THREADS) and CPU kernels need
    # not be this one's, so the same output to float64 rounding, not bit for bit
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), want, rtol=1e-12, atol=1e-14)


def test_a_source_round_trips_through_json_and_keeps_its_hash():
    source = read_source(str(PLUGINS / "ssmax.py"))
    again = PluginSource.from_dict(source.to_dict())
    assert again == source and again.sha256 == source.sha256
    with pytest.raises(PluginError, match="its files do not match sha256"):
        PluginSource.from_dict({**source.to_dict(), "sha256": "0" * 64})


# --- attention check -------------------------------------------------------------------------------------------

@pytest.mark.cuda_proxy
@pytest.mark.parametrize("name", SHIPPED)
def test_each_shipped_plugin_passes_attention_check(name, capsys):
    assert main(["attention", "check", f"{PLUGINS / name}.py"]) == 0
    lines = capsys.readouterr().out.splitlines()
    verdicts = [line for line in lines if line.startswith(("PASS", "FAIL"))]
    checks = [line.split(": ")[1] for line in verdicts]
    assert checks == ["reference", "causality", "fused vs reference (float64)", "ALiBi", "sharpening",
                      "bf16 autocast", "memory", "lowering"], lines
    for line in verdicts:  # every difference with the tolerance it is judged against
        assert len(re.findall(r"\|diff\| \S+ \(tolerance \S+\) at ", line)) == line.count("|diff|"), line
    assert "rows summing to 1 within " in verdicts[0] and " (tolerance 1.0e-09)" in verdicts[0]
    assert all(line.startswith(f"PASS {name}: ") for line in verdicts), lines
    memory = next(line for line in verdicts if ": memory: " in line)
    if name == "stickbreaking":  # reference only: its memory class is stated
        assert "reference only: training keeps O(T^2)" in memory and "no FlexAttention call" in verdicts[-1]
    else:
        assert "fused form O(T)" in memory and "1 FlexAttention call(s), forward and backward" in verdicts[-1]


BROKEN = '''
import math, torch
from attnlab.attention.plugin import Variant

def scores(q, k, rows, ctx):
    return q @ k.transpose(-1, -2) / math.sqrt(ctx.head_dim) + ctx.alibi(rows.h, rows.i, rows.j)

def softmax_rows(s, rows):
    return torch.softmax(s.masked_fill(~rows.visible, float("-inf")), dim=-1)

def wrong_reference(q, k, rows, ctx):
    return softmax_rows(scores(q, k, rows, ctx), rows)

def wrong_log_score(score, b, h, q_idx, kv_idx, ctx):
    return score / ctx.head_dim + ctx.alibi(h, q_idx, kv_idx)  # 1/d where the reference has 1/sqrt(d)

def future_mean(x, params, shape):  # every token sees the mean over the whole sequence
    mean = x.mean(dim=(1, 2))[:, None, None]
    return {"m": mean.expand(x.shape[0], shape.n_head, x.shape[1])}

def leaky_reference(q, k, rows, ctx):
    return softmax_rows(scores(q, k, rows, ctx) * (1 + ctx.state["m"][..., rows.i]), rows)

def leaky_log_score(score, b, h, q_idx, kv_idx, ctx):
    return (score / math.sqrt(ctx.head_dim) + ctx.alibi(h, q_idx, kv_idx)) * (1 + ctx.state["m"][b, h, q_idx])

def causal_log_score(score, b, h, q_idx, kv_idx, ctx):  # causal rows (m_i shifts a whole row: the softmax cancels it)
    return score / math.sqrt(ctx.head_dim) + ctx.alibi(h, q_idx, kv_idx) + ctx.state["m"][b, h, q_idx]

def unmasked_reference(q, k, rows, ctx):
    return torch.softmax(scores(q, k, rows, ctx), dim=-1)  # the mask forgotten

def no_alibi_reference(q, k, rows, ctx):
    return softmax_rows(q @ k.transpose(-1, -2) / math.sqrt(ctx.head_dim), rows)

def quadratic(q, k, v, ctx):  # materialises the T x T weights: not O(T)
    T = q.shape[-2]
    rows = torch.arange(T)[:, None]
    s = q @ k.transpose(-1, -2) / math.sqrt(ctx.head_dim) + ctx.alibi(torch.arange(q.shape[1])[:, None, None], rows,
                                                                     rows.T)
    return torch.softmax(s.masked_fill(rows.T > rows, float("-inf")), dim=-1) @ v

def gate(x, params, shape):
    c = torch.cumsum(-torch.nn.functional.softplus(x[..., : shape.n_head]), dim=1).transpose(1, 2)
    return {"c": c}

def gated_reference(q, k, rows, ctx):
    c = ctx.state["c"]
    return softmax_rows(scores(q, k, rows, ctx) + c[..., rows.i] - c[..., rows.j], rows)

def twice_log_score(score, b, h, q_idx, kv_idx, ctx):  # one tensor with gradients read at two indices
    c = ctx.state["c"]
    return score / math.sqrt(ctx.head_dim) + ctx.alibi(h, q_idx, kv_idx) + c[b, h, q_idx] - c[b, h, kv_idx]

VARIANTS = [
    Variant(name="wrong", reference=wrong_reference, log_score=wrong_log_score, normalised=True),
    Variant(name="leaky", reference=leaky_reference, log_score=leaky_log_score, prepare=future_mean, normalised=True),
    Variant(name="ahead", reference=leaky_reference, log_score=causal_log_score, prepare=future_mean),
    Variant(name="unmasked", reference=unmasked_reference),
    Variant(name="no_alibi", reference=no_alibi_reference),
    Variant(name="quadratic", reference=wrong_reference, fused=quadratic, normalised=True),
    Variant(name="twice", reference=gated_reference, log_score=twice_log_score, prepare=gate, normalised=True),
]
'''


@pytest.fixture(scope="module")
def broken_check(tmp_path_factory):
    """``attnlab attention check`` of BROKEN, run once for the tests below: (exit status, printed lines, FAIL lines by
    (variant, check))."""
    path = _write(tmp_path_factory.mktemp("broken") / "broken.py", BROKEN)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["attention", "check", str(path)])
    lines = out.getvalue().splitlines()
    return status, lines, {tuple(line.split(": ", 2)[:2]): line for line in lines if line.startswith("FAIL")}


@pytest.mark.cuda_proxy
def test_attention_check_names_what_is_broken(broken_check):
    status, _, failed = broken_check
    assert status == 1
    assert set(failed) == {("FAIL wrong", "fused vs reference (float64)"), ("FAIL wrong", "sharpening"),
                           ("FAIL leaky", "causality"), ("FAIL ahead", "causality"),
                           ("FAIL ahead", "fused vs reference (float64)"), ("FAIL unmasked", "causality"),
                           ("FAIL no_alibi", "ALiBi"), ("FAIL quadratic", "memory"), ("FAIL twice", "lowering")}, \
        sorted(failed)
    line = failed[("FAIL wrong", "fused vs reference (float64)")]
    assert "the fused form disagrees with its reference: log_score: forward max |diff|" in line and " at out b=" in line
    line = failed[("FAIL leaky", "causality")]
    assert "the reference form leaks the future: output b=" in line and "the fused form leaks the future" in line
    assert "the reference form leaks the future" in failed[("FAIL unmasked", "causality")]
    assert "the reference ignores ctx.alibi" in failed[("FAIL no_alibi", "ALiBi")]
    assert "the fused form's memory is not O(T)" in failed[("FAIL quadratic", "memory")]


@pytest.mark.cuda_proxy
def test_attention_check_prints_the_tolerance_beside_every_difference(broken_check):
    _, lines, failed = broken_check
    for line in lines:
        assert len(re.findall(r"\|diff\| \S+ \(tolerance \S+\) at ", line)) == line.count("|diff|"), line
    assert " (tolerance 1.0e-12) when the tokens after row " in failed[("FAIL leaky", "causality")]
    assert "|diff|" in failed[("FAIL wrong", "sharpening")]


@pytest.mark.cuda_proxy
def test_attention_check_reports_a_leak_before_the_disagreement_it_causes(broken_check):
    """A reference that leaks the future disagrees with a causal fused form: causality comes first, and the
    disagreement says it follows from it (a disagreement of two causal forms does not)."""
    _, lines, failed = broken_check
    ahead = [line for line in lines if line.startswith(("PASS ahead", "FAIL ahead"))]
    assert [line.split(": ")[1] for line in ahead][:3] == ["reference", "causality", "fused vs reference (float64)"]
    assert "the reference form leaks the future" in failed[("FAIL ahead", "causality")]
    assert failed[("FAIL ahead", "fused vs reference (float64)")].startswith(
        "FAIL ahead: fused vs reference (float64): follows from the causality failure above (fix that first): the "
        "fused form disagrees with its reference"), ahead
    assert "follows from" not in failed[("FAIL wrong", "fused vs reference (float64)")]


@pytest.mark.cuda_proxy
def test_a_lowering_failure_prints_torchs_cause_the_tensor_and_the_fix(broken_check):
    line = broken_check[2][("FAIL twice", "lowering")]
    assert ("log_score reads ctx.state['c'] at more than one index; torch says: NotImplementedError: Using multiple "
            "indexing operations on the same tensor that requires gradients in a score_mod function is not currently "
            "supported. This typically happens when indexing the same tensor multiple times. Fix: ") in line, line
    assert line.endswith("see docs/plugins.md#a-state-tensor-read-twice") and "..." not in line
    assert "\n#### A state tensor read twice\n" in (ROOT / "docs" / "plugins.md").read_text()


# --- the shipped plugins against their formulas ------------------------------------------------------------------

def test_stickbreaking_is_its_formula(plugins):
    """A_ij = beta_ij prod_{j<k<i} (1 - beta_ik) for j < i and the remainder prod_{j<i} (1 - beta_ij) on i, written
    as loops; the weights of every block of rows are those of the whole."""
    plugins(PLUGINS / "stickbreaking.py")
    spec = get_variant("stickbreaking")
    q, k, _ = _qkv(T=11, B=1, H=2)
    beta = torch.sigmoid(q @ k.transpose(-1, -2) / 4.0)
    want = torch.zeros(1, 2, 11, 11, dtype=torch.float64)
    for i in range(11):
        for j in range(i):
            want[..., i, j] = beta[..., i, j] * math.prod((1 - beta[..., i, m] for m in range(j + 1, i)), start=1.0)
        want[..., i, i] = math.prod((1 - beta[..., i, m] for m in range(i)), start=1.0)
    got = attention_weights(q, k, spec)
    assert (got - want).abs().max() < 1e-14
    assert torch.allclose(got.sum(-1), torch.ones((), dtype=torch.float64), atol=1e-14)
    blocks = torch.cat([reference_weights(q[..., r:r + 4, :], k, spec, row_start=r)[..., :] for r in range(0, 11, 4)],
                       dim=-2)
    # blocks of rows vs the whole matrix: q @ k^T through different BLAS shapes, so equal to float64 rounding, not
    # bit for bit (MKL's kernels differ by CPU and shape); a wrong row_start or mask moves weights by ~1e-1
    torch.testing.assert_close(blocks, got, rtol=1e-12, atol=1e-15)


def test_fox_is_softmax_plus_the_log_forget_gates_in_between(plugins):
    plugins(PLUGINS / "fox.py")
    spec = get_variant("fox")
    T = 9
    q, k, _ = _qkv(T=T, B=1, H=2)
    state = _state(spec, T=T, B=1)
    gate = state.params
    x = torch.randn(1, T, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    log_f = F.logsigmoid(x @ gate.weight.T + gate.bias)[0].T  # (H, T)
    s = q[0] @ k[0].transpose(-1, -2) / 4.0
    for i in range(T):
        for j in range(i + 1):
            s[:, i, j] += log_f[:, j + 1:i + 1].sum(-1)  # D_ij = sum_{l=j+1..i} log f_l
    want = torch.softmax(s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")), dim=-1)
    assert (attention_weights(q, k, spec, state=state)[0] - want).abs().max() < 1e-13
    with torch.no_grad():  # a gate open everywhere (f = 1): softmax itself
        gate.bias.fill_(50.0)
        gate.weight.zero_()
    open_gate = prepare_state(spec, x, gate, state.shape)
    softmax = attention_weights(q, k, get_variant("softmax"))
    assert (attention_weights(q, k, spec, state=open_gate) - softmax).abs().max() < 1e-12


def test_ssmax_with_every_s_at_one_is_the_builtin_softmax_logn(plugins):
    plugins(PLUGINS / "ssmax.py")
    spec = get_variant("ssmax")
    q, k, v = _qkv()
    state = _state(spec)
    assert torch.equal(state.params.s, torch.full((2,), 0.43).double())  # the initial s
    with torch.no_grad():
        state.params.s.fill_(1.0)
    state = prepare_state(spec, None, state.params, state.shape)
    want = attend(q, k, v, get_variant("softmax_logn"), impl="dense")
    for impl in ("dense", "flex"):
        assert (attend(q, k, v, spec, impl=impl, state=state) - want).abs().max() < 1e-12, impl
