"""The training planner: a model spec, its parallel layout, compute, memory, the step predictor,
`plan --search`, mixture of experts and FP8, pricing communication with `ringtree.sim.network`."""
