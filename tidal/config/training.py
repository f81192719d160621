"""Training-loop configuration: batch sizes, epochs, evaluation cadence, optimizer and schedule."""

from __future__ import annotations

from dataclasses import dataclass

from tidal.config.args import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, UNIT, Checked, ConfigError, Range, arg

LR_SCHEDULERS = ("cosine_with_min_lr", "cosine", "linear", "constant", "constant_with_warmup")
OPTIMIZERS = ("adam", "muon")


@dataclass
class TrainConfig(Checked):
    """Training loop: batch sizes, epochs, evaluation and seeding."""

    train_batch_size: int = arg(
        128, help="global batch size (samples) of one optimizer step", check=AT_LEAST_ONE
    )
    micro_train_batch_size: int = arg(
        8, help="samples per forward/backward on one device", check=AT_LEAST_ONE
    )
    max_epochs: int = arg(1, help="passes over the training data", check=AT_LEAST_ONE)
    eval_steps: int = arg(
        -1,
        help="evaluate every N optimizer steps (-1: at the end of each epoch only)",
        check=Range(1, also=(-1,)),
    )
    packing_samples: bool = arg(
        False, help="pack each micro-batch into one row without attention across samples"
    )
    seed: int = arg(42, help="random seed (data order, initialisation, dropout)")
    full_determinism: bool = arg(False, help="use deterministic torch algorithms (slower)")

    def batch_problems(self, world_size: int) -> list[str]:
        """The global batch must split evenly over devices and micro-batches."""
        per_rank, rem = divmod(self.train_batch_size, world_size)
        if rem or per_rank % self.micro_train_batch_size:
            return [
                f"--train_batch_size {self.train_batch_size} must be divisible by "
                f"--micro_train_batch_size {self.micro_train_batch_size} x {world_size} device(s)"
            ]
        return []

    def micro_steps_per_step(self, world_size: int) -> int:
        """Gradient-accumulation count (raises if the batch does not split, see ``batch_problems``)."""
        problems = self.batch_problems(world_size)
        if problems:
            raise ConfigError(problems[0])
        return self.train_batch_size // world_size // self.micro_train_batch_size


@dataclass
class OptimConfig(Checked):
    """Optimizer (AdamW, or Muon for hidden matrices) and learning-rate schedule."""

    optim: str = arg(
        "adam",
        help="adam: AdamW for every parameter; muon: torch.optim.Muon for the 2-D hidden weights (the "
        "transformer's linear layers) and AdamW for embeddings, norms, biases and output heads",
        choices=OPTIMIZERS,
    )
    learning_rate: float = arg(5e-6, help="peak learning rate (AdamW's)", check=POSITIVE)
    lr_warmup_ratio: float = arg(
        0.03, help="fraction of steps spent warming up linearly from 0", check=Range(0, 1, high_open=True)
    )
    lr_scheduler: str = arg(
        "cosine_with_min_lr", help="learning-rate schedule after warmup", choices=LR_SCHEDULERS
    )
    min_lr_ratio: float = arg(0.1, help="cosine_with_min_lr decays to learning_rate x this ratio", check=UNIT)
    l2: float = arg(
        0.0, help="weight decay (AdamW's; with --optim muon, Muon's too, as OpenRLHF)", check=NON_NEGATIVE
    )
    adam_betas: tuple[float, float] = arg(
        (0.9, 0.95),
        help="AdamW betas",
        nargs=2,
        metavar=("BETA1", "BETA2"),
        check=Range(0, 1, high_open=True),
    )
    adam_eps: float = arg(1e-8, help="AdamW epsilon", check=POSITIVE)
    muon_lr: float = arg(0.02, help="--optim muon: Muon's peak learning rate", check=POSITIVE)
    muon_momentum: float = arg(0.95, help="--optim muon: Muon's momentum", check=Range(0, 1, high_open=True))
    muon_ns_steps: int = arg(
        5, help="--optim muon: Newton-Schulz iterations orthogonalising each update", check=AT_LEAST_ONE
    )
    muon_nesterov: bool = arg(True, help="--optim muon: Nesterov momentum (--no-muon_nesterov: plain)")
    max_norm: float = arg(
        1.0, help="clip the gradient norm to this value (0 disables clipping)", check=NON_NEGATIVE
    )
    max_nonfinite_steps: int = arg(
        3,
        help="stop after this many optimizer steps in a row had a non-finite loss or gradient norm "
        "(each such step is skipped; tidal-only, OpenRLHF has no equivalent)",
        check=AT_LEAST_ONE,
    )
