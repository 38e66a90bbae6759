"""``attnlab export RUN_OR_CHECKPOINT --to DIR``: argument handling only; the export is :mod:`attnlab.export.folder`.

Bad input (an unknown run, a run without a checkpoint, a destination that exists without ``--overwrite``, a
plugin whose code does not match its recorded sha256, ...) is one line and exit status 2, with nothing written.
"""

from __future__ import annotations


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "export", help="export a run (its latest checkpoint) to a Hugging Face model folder",
        description="Write a checkpoint as a Hugging Face model folder: config.json, model.safetensors, "
        "generation_config.json, the tokenizer, self-contained modeling code (AutoModelForCausalLM.from_pretrained("
        "DIR, trust_remote_code=True) loads it offline, without attnlab) and a model card (docs/export.md).")
    p.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT",
                   help="a run folder (its latest checkpoint) or a checkpoint folder, a path or an s3://, gs:// URI")
    p.add_argument("--to", required=True, metavar="DIR", help="the folder to write (a path or an s3://, gs:// URI); "
                   "it must not exist, or be empty, unless --overwrite")
    p.add_argument("--store", help="a results store (path or URI): the model card gets the run's extrapolation table")
    p.add_argument("--overwrite", action="store_true", help="replace DIR if it exists")
    p.add_argument("--p-eval", default="run", help="the sharpening power config.json sets (default: the run's "
                   "p_train; none: no sharpening; a number >= 1)")
    p.add_argument("--rope-scaling", default="none", help="the RoPE scaling config.json sets beyond the training "
                   "length: none (default), ntk, pi or yarn")
    p.set_defaults(func=_export)


def _export(args) -> int:
    from attnlab.export import export_run

    folder = export_run(args.checkpoint, args.to, store=args.store, overwrite=args.overwrite, p_eval=args.p_eval,
                        rope_scaling=args.rope_scaling)
    print(f"exported to {folder.uri}: AutoModelForCausalLM.from_pretrained({folder.uri!r}, trust_remote_code=True)")
    return 0
