"""``attnlab attention list`` and ``attnlab attention check FILE_OR_MODULE[:NAME]``: argument handling only; the
dispatch is backends.py, the checks plugin_check.py.

``list`` prints every variant with the backend ``auto`` picks for it on a GPU (and sharpened, with ``p = 3``). A bad
plugin (missing, a syntax or import error, a malformed Variant, a name collision) is one line and exit status 2; a
check that fails is its FAIL line and exit status 1; every check passing, 0.
"""

from __future__ import annotations

import time


def add_parser(subparsers) -> None:
    attention = subparsers.add_parser("attention", help="attention variants: list them with their GPU path, check a "
                                      "plugin's", description="The attention variants (docs/attention.md), and those "
                                      "written outside attnlab (docs/plugins.md).")
    sub = attention.add_subparsers(dest="attention_command", metavar="ACTION")
    sub.required = True
    listing = sub.add_parser(
        "list", help="every variant and the backend auto picks for it on a GPU",
        description="Every registered variant (and a plugin's, with --plugin) with the backend attend(impl='auto') "
        "picks on CUDA: sdpa, triton (attnlab's Triton kernels), flex (FlexAttention) or dense; on CPU auto is dense "
        "(docs/attention.md#which-backend-runs).")
    listing.add_argument("--plugin", action="append", default=[], metavar="FILE_OR_MODULE",
                         help="load this plugin's variants too (repeatable)")
    listing.set_defaults(func=_list)
    p = sub.add_parser(
        "check", help="check a plugin's variants keep the contract (one verdict line per check)",
        description="Load a plugin (a .py file or an importable module, optionally :NAME for one variant) and check "
        "each variant on CPU: its reference, fused against reference forward and backward in float64, ALiBi, "
        "causality, bf16 autocast, the fused form's memory growing O(T), and the compiled training graph lowered "
        "through inductor as far as CPU allows. Exit status 0 only if every check passes (docs/plugins.md#check).")
    p.add_argument("plugin", metavar="FILE_OR_MODULE[:NAME]", help="path to a .py file or a module name, e.g. "
                   "plugins/fox.py or plugins/fox.py:fox")
    p.set_defaults(func=_check)


def _list(args) -> int:
    from attnlab.attention import get_variant, variant_names
    from attnlab.attention.plugin import load_plugin

    for ref in args.plugin:
        load_plugin(ref)
    rows = [("variant", "p", "GPU path", "sharpened (p=3)")]
    for name in variant_names():
        spec = get_variant(name)
        sharpened = _sharpened_path(spec)
        rows.append((name, "-" if spec.p is None else f"{spec.p:g}", _path(spec), sharpened))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


def _path(spec) -> str:
    from attnlab.attention.backends import choose_backend

    backend, fallback = choose_backend(spec, "cuda")
    return backend.value if fallback is None else f"{backend.value} (no fused form)"


def _sharpened_path(spec) -> str:
    if spec.p is not None:
        return _path(spec)
    try:
        return _path(spec.replace(p=3.0))
    except ValueError:  # a plugin that does not declare normalised rows cannot be sharpened
        return "-"


def _check(args) -> int:
    from attnlab.attention.plugin import load_plugin, parse_ref, unload_plugin
    from attnlab.attention.plugin_check import check_plugin, checked_names

    start = time.perf_counter()
    loaded = load_plugin(args.plugin)
    try:  # a check leaves nothing registered behind (its variants' names stay free for the caller)
        _, name = parse_ref(args.plugin)
        names = checked_names(loaded, name)
        print(f"attention check {loaded.source.origin} (sha256 {loaded.source.short_hash}): {', '.join(names)}",
              flush=True)
        for spec in loaded.specs:
            if spec.name in names:
                print(f"{spec.name}: on a GPU, impl='auto' runs {_path(spec)}", flush=True)
        ok = check_plugin(loaded, names, say=lambda line: print(line, flush=True))
    finally:
        unload_plugin(loaded)
    print(f"{'all checks passed' if ok else 'some checks FAILED'} in {time.perf_counter() - start:.1f} s", flush=True)
    return 0 if ok else 1
