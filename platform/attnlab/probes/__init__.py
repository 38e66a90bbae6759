"""Probes of trained models for the orbit study (evaluation level): what an orbit model predicts at 1x..16x
its training length, whether its hidden states carry the Newtonian force, and which law that force follows.

- :mod:`attnlab.probes.orbit_eval`: ``orbit_scores``, ``orbit_length_rows`` (val_loss, acc, coord_bin_err,
  coord_err_au at each length, as results rows).
- :mod:`attnlab.probes.force`: ``finetune_force_probe``, ``linear_force_probe`` -> ``ForceProbeResult``;
  ``probe_rows``.
- :mod:`attnlab.probes.symbolic`: ``fit_force_law`` (gplearn symbolic regression + power-law fit) ->
  ``ForceLaw``; ``fit_power_law``.

Nothing here imports Ray, the training loop or the study runner; submodules are imported on use (gplearn and
sympy load only for symbolic regression).
"""
