"""The statistics engine: bit-cipher codes (``codes``), streaming accumulators whose states are
mergeable sums (``accumulators``), devices and hosts (``distributed``: meshes, document shards,
sums over processes), exact counts of distinct rows and their merges (``rows``), the closed-form
smoothing formulas (``explicit``) and FLOP / memory accounting (``accounting``)."""
