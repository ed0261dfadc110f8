"""The flags of ``hlbp simulate`` as one dataclass: declared once, checked once, made into the SimConfig once.

Each field is a flag and an ``HLBP_*`` variable (:func:`hlbp.cli.options.flag`); peer-side types are imported only
where they are needed, so ``hlbp --help`` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hlbp.cli.options import flag
from hlbp.peer.common.errors import UserInputError
from hlbp.protocol.manifest import MAX_COMMITTEE

if TYPE_CHECKING:
    from hlbp.peer.sim.launcher import SimConfig


@dataclass
class SimFlags:
    """What ``hlbp simulate`` was told. ``--quick`` sets the replicas, rounds and inner steps of a smoke run; values
    no simulation can run with are refused (UserInputError)."""

    full: int = flag(4, "--full", env="SIM_FULL", help="Full replicas to start on loopback.")
    swarms: int = flag(0, "--swarms", env="SIM_SWARMS",
                       help="Pipeline swarms to start beside the full replicas, each of --stages stage peers; every "
                            "stage peer contributes its own shard to the same SparseLoCo rounds.")
    stages: int = flag(2, "--stages", env="SIM_STAGES",
                       help="Stages of the run's partition: the shards of every round, and the stage peers per swarm.")
    codec: str = flag("dense", "--codec", env="SIM_CODEC",
                      help="Activation codec of the swarms' stage boundaries: dense, subspace-a, subspace-b or "
                           "subspace-a-drift (full replicas never compress activations).")
    codec_k: int = flag(0, "--codec-k", env="SIM_CODEC_K", help="Rank k of a subspace codec (0: d/32).")
    micro_batches: int = flag(2, "--micro-batches", env="SIM_MICRO_BATCHES",
                              help="Micro-batches per inner step of each swarm's driver.")
    rounds: int = flag(5, "--rounds", env="SIM_ROUNDS", help="Outer rounds every replica runs.")
    model: str = flag("tiny", "--model", env="SIM_MODEL", help="Model preset of the simulated run.")
    inner_steps: int = flag(10, "--inner-steps", env="SIM_INNER_STEPS", help="Inner steps per round (H).")
    batch_size: int = flag(4, "--batch-size", env="SIM_BATCH_SIZE", help="Sequences per inner step.")
    seq_len: int = flag(64, "--seq-len", env="SIM_SEQ_LEN", help="Tokens per sequence.")
    deadline: float = flag(5.0, "--deadline", env="SIM_DEADLINE", help="First round's collection window (s).")
    threads: int = flag(1, "--threads", env="SIM_THREADS", help="torch CPU threads per peer.")
    seed: int = flag(0, "--seed", env="SIM_SEED", help="Seed of the run: initial weights and data order.")
    outer: str = flag("sparseloco", "--outer", env="SIM_OUTER",
                      help="Outer step: sparseloco (sparse rounds), diloco (dense rounds through hivemind's stock "
                           "DecentralizedAverager, the baseline) or noloco (seeded pairs, no all-reduce).")
    noloco_payload: str = flag("dense", "--noloco-payload", env="SIM_NOLOCO_PAYLOAD",
                               help="--outer noloco: what partners swap, the paper's dense outer weights and progress "
                                    "(dense) or SparseLoCo's payload (sparse).")
    aggregation: str = flag("selectors", "--aggregation", env="SIM_AGGREGATION",
                            help="SparseLoCo aggregation: selectors (mean over the replicas that chose a value) or "
                                 "mean (1/R, zero where not chosen).")
    clip: bool = flag(True, "--clip/--no-clip", env="SIM_CLIP",
                      help="Median-norm clipping of contributions (the hostile-peer defence).")
    small_tensors: str = flag("topk", "--small-tensors", env="SIM_SMALL_TENSORS",
                              help="SparseLoCo's 1-D and sub-chunk tensors: topk (the run's k) or dense (every "
                                   "value, 2-bit).")
    overlap: str = flag("", "--overlap", env="SIM_OVERLAP",
                        help="Overlap each round's exchange with the next inner phase: none, naive (one round late) "
                             "or eager (one round late, plus each peer's own latest contribution). Full replicas "
                             "only; stage peers run their rounds in turn. Default: the outer's (eager for "
                             "sparseloco, none for diloco).")
    wan_delay_ms: float = flag(0.0, "--wan-delay-ms", env="SIM_WAN_DELAY_MS",
                               help="Emulate a WAN: every peer sits behind a proxy that delays each direction by "
                                    "this many ms (round trip: twice this).")
    wan_mbps: float | None = flag(None, "--wan-mbps", env="SIM_WAN_MBPS",
                                  help="Emulate a WAN: each peer's link carries at most this many Mbit/s each way.")
    swarm_wan_delay_ms: float | None = flag(None, "--swarm-wan-delay-ms", env="SIM_SWARM_WAN_DELAY_MS",
                                            help="The stage peers' one-way delay, when it differs from --wan-delay-ms.")
    swarm_wan_mbps: float | None = flag(None, "--swarm-wan-mbps", env="SIM_SWARM_WAN_MBPS",
                                        help="The stage peers' link rate, when it differs from --wan-mbps (weak peers "
                                             "sit behind slower links).")
    gather: int = flag(0, "--gather", env="SIM_GATHER",
                       help="Cap each round at this many contributions per shard, chosen by the run's gather rule "
                            "(veterans rotate, a few newcomers a round); 0: every contribution.")
    reserves: int = flag(0, "--reserves", env="SIM_RESERVES",
                         help="With --gather: further contributions the coordinator checks to replace selected ones "
                              "that cannot be fetched or fail a bound.")
    committee: int = flag(0, "--committee", env="SIM_COMMITTEE",
                          help="With --gather: seats of the round committee that takes the notices and passes the "
                               "accepted set on, so a peer's round records stay bounded; 0: every record to every peer.")
    timeout: float = flag(600.0, "--timeout", env="SIM_TIMEOUT", help="Stop everything after this many seconds.")
    workdir: Path | None = flag(
        None, "--workdir", env="SIM_WORKDIR",
        help="Logs, keys, checkpoints and metrics of the peers (default: a new temporary directory).")
    cache_dir: Path | None = flag(None, "--cache-dir", env="CACHE",
                                  help="Cache for corpus and tokenizer [~/.cache/hlbp].")
    out: Path | None = flag(None, "--out", env="SIM_OUT", help="Also write the report as JSON to this file.")
    fork: bool = flag(True, "--fork/--no-fork", env="SIM_FORK",
                      help="Fork every process from one interpreter that imported torch and hivemind once (a "
                           "zygote; 3-7 CPU-s less per process); --no-fork starts each as a fresh interpreter.")
    quick: bool = flag(False, "--quick/--no-quick", env="SIM_QUICK",
                       help="A fast smoke run: 2 replicas, 2 rounds, 5 inner steps.")

    def __post_init__(self) -> None:
        from hlbp.protocol.manifest import CodecSpec, Hyperparameters

        if self.quick:
            self.full, self.rounds, self.inner_steps = 2, 2, 5
        overlap, outer, codec = self.overlap, self.outer, self.codec
        if self.wan_delay_ms < 0 or self.wan_mbps is not None and self.wan_mbps <= 0:
            raise UserInputError("--wan-delay-ms must be >= 0 and --wan-mbps > 0")
        if outer not in Hyperparameters.OUTERS:
            raise UserInputError(f"--outer must be one of {', '.join(Hyperparameters.OUTERS)}, got {outer!r}")
        if self.noloco_payload not in Hyperparameters.NOLOCO_PAYLOADS:
            raise UserInputError(f"--noloco-payload must be dense or sparse, got {self.noloco_payload!r}")
        if self.aggregation not in ("selectors", "mean"):
            raise UserInputError(f"--aggregation must be selectors or mean, got {self.aggregation!r}")
        if overlap and overlap not in Hyperparameters.OVERLAPS:
            raise UserInputError(f"--overlap must be none, naive or eager, got {overlap!r}")
        if overlap not in ("", "none") and outer != "sparseloco":
            raise UserInputError("--overlap works with --outer sparseloco only")
        if overlap not in ("", "none") and codec in CodecSpec.CONSTRAINED:
            raise UserInputError(f"--codec {codec} trains constrained full replicas, which do not overlap yet; "
                                 "leave --overlap out or set it to none")
        if self.small_tensors not in Hyperparameters.SMALL_TENSORS:
            raise UserInputError(f"--small-tensors must be topk or dense, got {self.small_tensors!r}")
        if self.full < 0 or self.swarms < 0 or self.full + self.swarms < 1:
            raise UserInputError("--full and --swarms must be >= 0, and together start at least one peer")
        if self.swarms and outer != "sparseloco":
            raise UserInputError("pipeline swarms take part in sparseloco rounds only; use --outer sparseloco")
        if self.stages < 1 or self.swarms and self.stages < 2:
            raise UserInputError("--stages must be >= 1, and >= 2 for pipeline swarms")
        for name, value in (("--swarm-wan-delay-ms", self.swarm_wan_delay_ms),
                            ("--swarm-wan-mbps", self.swarm_wan_mbps)):
            if value is not None and (value < 0 or name.endswith("mbps") and value <= 0):
                raise UserInputError(f"{name} must be positive")
        if self.gather < 0 or self.reserves < 0 or self.gather > 256 or self.reserves and not self.gather:
            raise UserInputError("--gather must be in 0..256 and --reserves >= 0, with --gather when given")
        if self.gather and outer != "sparseloco":
            raise UserInputError("--gather caps sparseloco rounds only")
        if not 0 <= self.committee <= MAX_COMMITTEE or self.committee and not self.gather:
            raise UserInputError(f"--committee must be in 0..{MAX_COMMITTEE}, with --gather when given")
        if (self.rounds < 1 or self.inner_steps < 1 or self.batch_size < 1 or self.seq_len < 2 or self.threads < 1
                or self.micro_batches < 1):
            raise UserInputError("--rounds, --inner-steps, --batch-size, --micro-batches and --threads must be >= 1")

    @property
    def overlap_mode(self) -> str:
        """The overlap the run will use: --overlap, or when it is left out the manifest's default (the outer's,
        none for a variant-A codec; records.Hyperparameters)."""
        from hlbp.protocol.manifest import CodecSpec, Hyperparameters

        constrained = self.codec in CodecSpec.CONSTRAINED
        return self.overlap or Hyperparameters.default_overlap(self.outer, constrained)

    def config(self) -> SimConfig:
        """The simulation these flags describe (the manifest's hyperparameters and how the processes start)."""
        from hlbp.peer.sim.launcher import SimConfig

        return SimConfig(
            n_full=self.full, rounds=self.rounds, model=self.model, inner_steps=self.inner_steps,
            batch_size=self.batch_size, seq_len=self.seq_len, round_deadline_s=self.deadline,
            min_deadline_s=min(1.0, self.deadline), max_deadline_s=max(30.0, self.deadline), seed=self.seed,
            outer=self.outer, noloco_payload=self.noloco_payload, threads=self.threads, cache_dir=self.cache_dir, aggregation=self.aggregation,
            clip_median=self.clip, small_tensors=self.small_tensors, overlap=self.overlap,
            wan_delay_ms=self.wan_delay_ms, wan_mbps=self.wan_mbps, n_stages=self.stages, n_swarms=self.swarms,
            micro_batches=self.micro_batches, codec=self.codec, codec_k=self.codec_k,
            swarm_wan_delay_ms=self.swarm_wan_delay_ms, swarm_wan_mbps=self.swarm_wan_mbps, fork=self.fork,
            gather=self.gather, reserves=self.reserves, committee=self.committee,
        )
