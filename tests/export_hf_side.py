"""The transformers side of tests/test_export.py, run as one clean subprocess: ``python export_hf_side.py JOBS.json``.

attnlab cannot be imported here (a meta-path finder refuses ``attnlab`` and every ``attnlab.*``, whatever
``sys.path`` holds), the hub is offline (``HF_HUB_OFFLINE=1``, set by the caller) and the working directory is a
temporary folder. For each job it loads an exported folder with ``AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True)`` and reports, as one JSON object on the last line of stdout:

- ``logits``: per case and setting, the largest absolute difference from the reference logits attnlab computed
  (saved by the test beside the folder), and which modeling modules ran (none may come from attnlab);
- ``generate``: the tokens ``model.generate`` produced (with and without ``use_cache``);
- ``errors``: the one-line error of a job expected to fail (a tampered plugin);
- ``tokenizer``: per tokenizer and call (``AutoTokenizer`` with and without ``trust_remote_code``, ``GPT2Tokenizer``),
  the ids it gives for a text, whether transformers asked to run the folder's code (stdin is at end of file, so
  a prompt is answered no at once) and the warnings transformers logged. These jobs run first, before any model is
  loaded, so nothing transformers registered for a model changes what they see.

Each job's failure is caught and reported under its name, so one broken case does not hide the others.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import io
import json
import logging
import sys
import traceback


class _NoAttnlab(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "attnlab" or fullname.startswith("attnlab."):
            raise ImportError(f"attnlab is not importable in this process ({fullname})")
        return None


sys.meta_path.insert(0, _NoAttnlab())

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Tokenizer  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()


def _load(folder: str):
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()


def _logits(job: dict) -> dict:
    model = _load(job["folder"])
    ref = torch.load(job["reference"])
    out = {"modules": sorted({type(m).__module__ for m in model.modules()})}
    for setting in job["settings"]:
        for key, value in setting.get("config", {}).items():
            setattr(model.config, key, value)
        for length in setting["lengths"]:
            with torch.no_grad():
                got = model(ref["ids"][:, :length]).logits
            want = ref[f"{setting['label']}@{length}"]
            out[f"{setting['label']}@{length}"] = float((got - want).abs().max()) if got.shape == want.shape else \
                f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    return out


def _generate(job: dict) -> dict:
    model = _load(job["folder"])
    prompt = torch.tensor([job["prompt"]])
    out = {}
    for use_cache in (False, True):
        with torch.no_grad():
            tokens = model.generate(prompt, max_new_tokens=job["new_tokens"], do_sample=False, use_cache=use_cache,
                                    eos_token_id=None, pad_token_id=job["pad"])
        out[f"use_cache={use_cache}"] = tokens[0, prompt.shape[1]:].tolist()
    return out


def _error(job: dict) -> str:
    try:
        _load(job["folder"])
    except Exception as exc:  # noqa: BLE001 - the message is what the test reads
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


PROMPT = "Do you wish to run the custom code?"  # transformers' question (dynamic_module_utils)
TOKENIZER_CALLS = {
    "AutoTokenizer": lambda folder: AutoTokenizer.from_pretrained(folder),
    "AutoTokenizer(trust_remote_code=True)": lambda folder: AutoTokenizer.from_pretrained(folder,
                                                                                          trust_remote_code=True),
    "GPT2Tokenizer": lambda folder: GPT2Tokenizer.from_pretrained(folder),
}


def _tokenizer(job: dict) -> dict:
    """Each call's ids for the text, whether it asked to run custom code, and transformers' warnings meanwhile."""
    out = {}
    for call, load in TOKENIZER_CALLS.items():
        records, printed = [], io.StringIO()
        handler = logging.Handler(logging.WARNING)
        handler.emit = records.append
        root = logging.getLogger("transformers")
        root.addHandler(handler)
        hf_logging.set_verbosity_warning()
        try:
            with contextlib.redirect_stdout(printed):
                tokenizer = load(job["folder"])
        finally:
            hf_logging.set_verbosity_error()
            root.removeHandler(handler)
        out[call] = {"ids": tokenizer(job["text"]).input_ids, "prompted": PROMPT in printed.getvalue(),
                     "warnings": [record.getMessage() for record in records]}
    return out


def main(path: str) -> None:
    with open(path) as f:
        jobs = json.load(f)
    report = {"logits": {}, "generate": {}, "errors": {}, "tokenizer": {}, "failed": {},
              "attnlab_importable": True}
    try:
        import attnlab  # noqa: F401
    except ImportError:
        report["attnlab_importable"] = False
    run = {"logits": _logits, "generate": _generate, "errors": _error, "tokenizer": _tokenizer}
    for job in sorted(jobs, key=lambda job: job["kind"] != "tokenizer"):  # the tokenizers first (docstring)
        try:
            report[job["kind"]][job["name"]] = run[job["kind"]](job)
        except Exception:  # noqa: BLE001 - reported per job
            report["failed"][job["name"]] = traceback.format_exc(limit=6)
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
