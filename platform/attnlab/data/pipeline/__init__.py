"""The prepare pipeline: document sources (``corpora``, with the offline demo texts of ``demo_corpus``) in,
shuffled, tokenised, verified token shards out (``prepare``), its work items run as Ray tasks when asked
(``parallel``, the only Ray code of ``attnlab.data``). It writes the format of :mod:`attnlab.data.shards`,
which the readers (:mod:`attnlab.data.readers`) read; it never reads batches."""
