"""One trial per point: the claim registry of a study run, which knows whether the trial holding a point is alive.

A search may propose the same point twice (TPE does on a small categorical space), and a restarted trial proposes
its own again. Two trials of one training key must never train the same run folder at once, and the second should
reuse the first's run. The study driver's process starts one :class:`ClaimRegistry` actor (named, owned by the
driver, so it ends with it: claims of an earlier, killed driver are not in it); each ``study run`` has a name of
its own there (:func:`start_registry`), under which its trials claim their keys (:func:`claim_point`) before they
train and release them when their status is written (:func:`release_point`). A driver that runs several studies
(``run_study`` from Python: a notebook, the tests) starts the actor once, not once per study (an actor is a
process: about 2 s of CPU); the keys of one run never meet another's.

A trial that finds its key held waits on the holder's *hold*: an ``ObjectRef`` of a registry call that returns
when the holder releases, and that the holder's process owns. Ray fails a borrowed reference whose owner died
(``OwnerDiedError``) as soon as it learns of the death, so the waiter knows within moments both when its twin is
done and when its twin's process was killed without a word; it then takes the key over and resumes the run from
its latest checkpoint. No status file is polled and nothing sleeps.

The status files (:mod:`attnlab.study.folder`) still say which trial holds a run, for the console and the page;
they are no longer what coordinates. Never imports torch; Ray only inside functions (and the actor's class is
made a Ray actor where it is started).
"""

from __future__ import annotations

import asyncio
import uuid

REGISTRY_PREFIX = "attnlab-claims"
NAMESPACE = "attnlab"  # registries are found by name from any job of the cluster (a trial, a test's process)


class ClaimRegistry:
    """The claims of one driver's study runs (an async Ray actor, made one by :func:`start_registry`; keys are
    ``RUN/train_key``): per key, the trial that holds it and that trial's hold; per key, the last release (its trial
    and the status it wrote)."""

    def __init__(self):
        self._holders: dict[str, tuple[str, str, list]] = {}  # key -> (trial, token, [hold ObjectRef])
        self._released: dict[str, dict] = {}  # key -> {"trial", "status"} of the last holder that released it
        self._events: dict[str, asyncio.Event] = {}  # token -> set when that claim is released

    async def hold(self, token: str) -> None:
        """Returns when the claim made with ``token`` is released; its ObjectRef, owned by the claiming trial's
        process, is what a twin waits on (see the module docstring)."""
        await self._events.setdefault(token, asyncio.Event()).wait()
        self._events.pop(token, None)

    def claim(self, key: str, trial: str, token: str, hold: list, dead: str | None = None) -> dict:
        """Give ``key`` to ``trial`` when nobody holds it, or it holds it already (Tune restarted that very trial),
        or its holder is ``dead`` (the caller saw that trial's process die). Returns ``{"holder": trial,
        "before": last release or None}`` when granted, else ``{"holder": other trial, "hold": [its hold]}``."""
        current = self._holders.get(key)
        if current is None or current[0] in (trial, dead):
            self._holders[key] = (trial, token, hold)
            return {"holder": trial, "before": self._released.get(key)}
        return {"holder": current[0], "hold": current[2]}

    def release(self, key: str, trial: str, status: str | None) -> None:
        """``trial`` is done with ``key``, having written ``status``; its twins stop waiting."""
        current = self._holders.get(key)
        if current is None or current[0] != trial:
            return
        del self._holders[key]
        self._released[key] = {"trial": trial, "status": status}
        self._events.setdefault(current[1], asyncio.Event()).set()

    def forget(self, run: str) -> None:
        """The study run ``run`` ended: drop its released keys (a key still held stays, its twins may wait on it)."""
        for key in [k for k in self._released if k.startswith(f"{run}/")]:
            del self._released[key]


def registry_name(study: str) -> str:
    """A name of its own for each study run's claims."""
    return f"{REGISTRY_PREFIX}:{study}:{uuid.uuid4().hex[:12]}"


_driver_registry: tuple | None = None  # ((GCS, job), actor name, handle): the calling driver's registry


def start_registry(study: str) -> str:
    """This study run's name (``ACTOR#RUN``, what its trials are given) in the calling driver's registry, which is
    started on the driver's first study run (no CPU) and held here for as long as the driver lives; call
    :func:`end_run` with the name when the run's trials have ended."""
    global _driver_registry
    import ray

    context = ray.get_runtime_context()
    driver = (context.gcs_address, context.get_job_id())
    actor_name = _driver_registry[1] if _driver_registry and _driver_registry[0] == driver else None
    if actor_name is not None:
        try:
            ray.get_actor(actor_name, namespace=NAMESPACE)
        except ValueError:  # gone (killed): a new one
            actor_name = None
    if actor_name is None:  # the first run of this driver connection (a handle of an earlier cluster is dead)
        actor_name = f"{REGISTRY_PREFIX}:{uuid.uuid4().hex[:12]}"
        actor = ray.remote(num_cpus=0, max_restarts=0)(ClaimRegistry).options(
            name=actor_name, namespace=NAMESPACE).remote()
        _driver_registry = (driver, actor_name, actor)
    return f"{actor_name}#{registry_name(study)}"


def _parts(registry: str) -> tuple[str, str]:
    """``(actor name, run)`` of a study run's ``ACTOR#RUN`` name."""
    actor, _, run = registry.partition("#")
    return actor, run


def _scoped(registry: str, key: str) -> tuple[str, str]:
    """``(actor name, RUN/key)`` of ``key`` in the study run ``registry`` names."""
    actor, run = _parts(registry)
    return actor, f"{run}/{key}"


def end_run(registry: str) -> None:
    """The study run ``registry`` names has ended (every trial with it): its released keys are dropped."""
    import ray

    actor, run = _parts(registry)
    ray.get_actor(actor, namespace=NAMESPACE).forget.remote(run)


def claim_point(registry: str | None, key: str, trial: str) -> dict:
    """Hold ``key`` for ``trial`` in the registry named ``registry``, waiting while a live twin holds it. Returns the
    key's last release in this study run (``{"trial", "status"}``: the twin's outcome), or {} when none; with no
    registry (a trial run outside a study driver) nothing is coordinated and {} is returned."""
    if registry is None:
        return {}
    import ray
    from ray.exceptions import OwnerDiedError

    name, key = _scoped(registry, key)
    actor = ray.get_actor(name, namespace=NAMESPACE)
    token = uuid.uuid4().hex
    hold = actor.hold.remote(token)  # owned by this process: a twin's wait on it fails when this process dies
    dead = None
    while True:
        answer = ray.get(actor.claim.remote(key, trial, token, [hold], dead))
        if answer["holder"] == trial:
            return dict(answer["before"] or {})
        try:
            ray.get(answer["hold"][0])  # returns when the twin releases the key
            dead = None
        except OwnerDiedError:  # the twin's process is gone: take the key over (its run resumes from a checkpoint)
            dead = answer["holder"]


def release_point(registry: str | None, key: str, trial: str, status: str | None) -> None:
    """Release ``key`` held by ``trial`` once its status file says ``status``."""
    if registry is None:
        return
    import ray

    name, key = _scoped(registry, key)
    ray.get(ray.get_actor(name, namespace=NAMESPACE).release.remote(key, trial, status))


__all__ = ["ClaimRegistry", "claim_point", "end_run", "registry_name", "release_point", "start_registry"]
