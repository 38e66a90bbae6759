"""Studies: a YAML spec (``spec``: a typed tree embedding the training and evaluation configs, no Ray) run as a
Ray Tune + Optuna search (``runner``: the only Tune/Optuna code) whose trials compose steps with their own
identities (``trial``: plan, train, evaluate, report), keeping their state in one runs folder
(``state``), submitted as a Ray Job (``submit``), with the ``attnlab study`` commands (``cli``).

Public API: ``load_spec(path) -> StudySpec``; ``attnlab.study.runner.run_study(spec, store=None, runs=None,
resume=None) -> StudySummary``; ``attnlab.study.submit.submit_study(study, address, ...) -> job id``.
Importing this package does not import Ray.
"""

from attnlab.study.spec import StudySpec, load_spec

__all__ = ["StudySpec", "load_spec"]
