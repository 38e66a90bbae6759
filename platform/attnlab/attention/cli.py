"""``attnlab attention check FILE_OR_MODULE[:NAME]``: argument handling only; the checks are in plugin_check.py.

A bad plugin (missing, a syntax or import error, a malformed Variant, a name collision) is one line and exit status
2; a check that fails is its FAIL line and exit status 1; every check passing, 0.
"""

from __future__ import annotations

import time


def add_parser(subparsers) -> None:
    attention = subparsers.add_parser("attention", help="attention variants from plugins: check one",
                                      description="Attention variants written outside attnlab (docs/plugins.md).")
    sub = attention.add_subparsers(dest="attention_command", metavar="ACTION")
    sub.required = True
    p = sub.add_parser(
        "check", help="check a plugin's variants keep the contract (one verdict line per check)",
        description="Load a plugin (a .py file or an importable module, optionally :NAME for one variant) and check "
        "each variant on CPU: its reference, fused against reference forward and backward in float64, ALiBi, "
        "causality, bf16 autocast, the fused form's memory growing O(T), and the compiled training graph lowered "
        "through inductor as far as CPU allows. Exit status 0 only if every check passes (docs/plugins.md#check).")
    p.add_argument("plugin", metavar="FILE_OR_MODULE[:NAME]", help="path to a .py file or a module name, e.g. "
                   "plugins/fox.py or plugins/fox.py:fox")
    p.set_defaults(func=_check)


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
        ok = check_plugin(loaded, names, say=lambda line: print(line, flush=True))
    finally:
        unload_plugin(loaded)
    print(f"{'all checks passed' if ok else 'some checks FAILED'} in {time.perf_counter() - start:.1f} s", flush=True)
    return 0 if ok else 1
