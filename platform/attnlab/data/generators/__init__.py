"""Generator sources: tokens made on the fly from a seed, never prepared or stored. The synthetic
mechanism probes (``synthetic``: copy, passkey, ...) and simulated planetary orbits (``orbits``, whose physics is
``orbit_sim``). Each implements :class:`attnlab.data.source.DataSource`, as prepared text does."""
