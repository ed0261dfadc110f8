"""hlbp.peer: the runtime of one node (model, data, trainer, outer optimizers, rounds)."""
