"""Studies: a YAML spec (``spec``: typed, validated, no Ray) run as a Ray Tune + Optuna search (``runner``: the
only Tune/Optuna code), submitted as a Ray Job (``submit``), with the ``attnlab study`` commands (``cli``).

Public API: ``load_spec(path) -> StudySpec``; ``attnlab.study.runner.run_study(spec, store=None, storage=None,
resume=None) -> StudySummary``; ``attnlab.study.submit.submit_study(study, address, ...) -> job id``.
Importing this package imports neither Ray nor torch.
"""

from attnlab.study.spec import StudySpec, load_spec

__all__ = ["StudySpec", "load_spec"]
