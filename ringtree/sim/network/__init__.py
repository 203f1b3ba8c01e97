"""The collective and network model: links and clusters, NCCL's cost models, closed-form and
replayed all-reduce and all-to-all times, and calibration from measured runs."""
