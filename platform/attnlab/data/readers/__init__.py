"""The readers of prepared data: batches of token windows from a folder written by the prepare pipeline
(``tokens``), local shards memory-mapped and shards in a bucket served by ranged reads and cached once per node
(``shard_cache``). They read the format of :mod:`attnlab.data.shards`; they never write it."""
