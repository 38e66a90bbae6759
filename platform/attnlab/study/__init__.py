"""Studies: a YAML spec (``spec``: a typed tree embedding the training and evaluation configs, no Ray) run as a
Ray Tune + Optuna search (``runner``: the only Tune/Optuna code) whose trials compose steps with their own
identities (``trial``: plan, train, evaluate, report), keeping their state in one runs folder
(``folder``), submitted as a Ray Job (``submit``), with the ``attnlab study`` commands (``cli``).

Public API: ``load_spec(path) -> StudySpec``; ``attnlab.study.runner.run_study(spec, store=None, runs=None,
resume=None) -> StudySummary``; ``attnlab.study.submit.submit_study(study, address, ...) -> job id``.
Importing this package imports neither Ray nor torch: ``load_spec`` and ``StudySpec`` load ``spec`` (and with it
torch) on first use, so a process that needs only a light module of the package (the claim registry's actor:
``claims``) starts in a third of the time.
"""

__all__ = ["StudySpec", "load_spec"]


def __getattr__(name: str):
    if name in __all__:
        from attnlab.study import spec

        return getattr(spec, name)
    raise AttributeError(f"module 'attnlab.study' has no attribute {name!r}")
