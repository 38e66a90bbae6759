"""One trial per point: the claim registry of a study run, which knows whether the trial holding a point is alive.

A search may propose the same point twice (TPE does on a small categorical space), and a restarted trial proposes
its own again. Two trials of one training key must never train the same run folder at once, and the second should
reuse the first's run. The study driver starts one :class:`ClaimRegistry` actor per ``study run`` (named, owned
by the driver, so it ends with the run: claims of an earlier, killed run are not in it); each trial claims its
key there (:func:`claim_point`) before it trains and releases it when its status is written
(:func:`release_point`).

A trial that finds its key held waits on the holder's *hold*: an ``ObjectRef`` of a registry call that returns
when the holder releases, and that the holder's process owns. Ray fails a borrowed reference whose owner died
(``OwnerDiedError``) as soon as it learns of the death, so the waiter knows within moments both when its twin is
done and when its twin's process was killed without a word; it then takes the key over and resumes the run from
its latest checkpoint. No status file is polled and nothing sleeps.

The status files (:mod:`attnlab.study.state`) still say which trial holds a run, for the console and the page;
they are no longer what coordinates. Never imports torch; Ray only inside functions (and the actor's class is
made a Ray actor where it is started).
"""

from __future__ import annotations

import asyncio
import uuid

REGISTRY_PREFIX = "attnlab-claims"
NAMESPACE = "attnlab"  # registries are found by name from any job of the cluster (a trial, a test's process)


class ClaimRegistry:
    """The claims of one study run (an async Ray actor, made one by :func:`start_registry`): per training key, the
    trial that holds it and that trial's hold; per key, the last release (its trial and the status it wrote)."""

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


def registry_name(study: str) -> str:
    """A name of its own for each study run's registry."""
    return f"{REGISTRY_PREFIX}:{study}:{uuid.uuid4().hex[:12]}"


def start_registry(study: str):
    """Start the study run's registry (no CPU; it lives as long as the calling driver). Returns ``(name,
    actor)``: trials find it by name; the caller keeps the actor handle for as long as the run lasts."""
    import ray

    name = registry_name(study)
    actor = ray.remote(num_cpus=0, max_restarts=0)(ClaimRegistry).options(name=name, namespace=NAMESPACE).remote()
    return name, actor


def claim_point(registry: str | None, key: str, trial: str) -> dict:
    """Hold ``key`` for ``trial`` in the registry named ``registry``, waiting while a live twin holds it. Returns the
    key's last release in this study run (``{"trial", "status"}``: the twin's outcome), or {} when none; with no
    registry (a trial run outside a study driver) nothing is coordinated and {} is returned."""
    if registry is None:
        return {}
    import ray
    from ray.exceptions import OwnerDiedError

    actor = ray.get_actor(registry, namespace=NAMESPACE)
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

    ray.get(ray.get_actor(registry, namespace=NAMESPACE).release.remote(key, trial, status))


__all__ = ["ClaimRegistry", "claim_point", "registry_name", "release_point", "start_registry"]
