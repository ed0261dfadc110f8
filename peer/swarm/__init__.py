"""Pipeline swarms over the network: weak peers each serve one stage, stage 0 drives (docs/design.md, "Pipeline
swarms").

- :mod:`worker`: one stage's compute with exactly-once gradient accumulation (pure, no network);
- :mod:`routing`: bans with backoff, deadlines from measured latency, the chain choice (pure);
- :mod:`links`: long-lived stage streams over hivemind's P2P;
- :mod:`server`: a stage peer serving forward and backward;
- :mod:`events`: what reaches the driver, as typed events decoded where a message arrives;
- :mod:`step`: the state of one step of the driver, its micro-batches and which are in flight (pure);
- :mod:`driver`: stage 0, its micro-batches in flight, retries and the step;
- :mod:`phase`: stage 0's inner phase of each outer round (steps, logging, validation), for the round loop.
"""
