"""The runs of the supervised trainers (SFT, RM, PRM, DPO, KTO, KD) and their loss configs.

Each ``tidal.trainers.<kind>`` module re-exports its run and configs; they live here so that a trainer's
command builds its parser (``--help``) without importing torch, transformers or datasets. A run's
checks that need the model or the world (ring attention, tensor-parallel layouts) import their modules
when a run is checked, not here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tidal.config.args import Checked, arg
from tidal.config.checkpoint import CheckpointConfig, trainer_checkpoints
from tidal.config.data import OPENRLHF_INPUT_TEMPLATE, DatasetConfig, HeldOutDatasetConfig, VisionConfig
from tidal.config.distributed import DistributedConfig, ring_layout_problems
from tidal.config.logging import LoggingConfig
from tidal.config.model import ModelConfig
from tidal.config.registries import RM_LOSS_NAMES
from tidal.config.run import RunConfig, config_field
from tidal.config.sample_data import PairDataConfig, PRMDataConfig, SFTDataConfig, UnpairedDataConfig
from tidal.config.training import OptimConfig, TrainConfig

if TYPE_CHECKING:
    from tidal.distributed import World


@dataclass
class ReferenceConfig:
    """Reference model of DPO/KTO: a frozen copy of the start model, or the LoRA base."""

    ref_pretrain: str | None = arg(
        None, help="reference model (default: --pretrain; under LoRA: the base with adapters disabled)"
    )
    ref_offload: bool = arg(
        False, help="keep the reference model in CPU memory; move it to the device only for its forward"
    )


@dataclass
class FusedHeadConfig:
    """Kernels: the fused LM-head loss (OpenRLHF's --use_liger_kernel switch)."""

    use_liger_kernel: bool = arg(
        False,
        help="compute the loss with tidal's fused LM head: the head runs inside the loss (KD: chunk by chunk, "
        "one chunk's logits at a time; PRM: only at step markers, only the reward tokens' rows) instead of "
        "full [batch, length, vocab] logits (SFT, DPO, KTO and PPO log-probs always do). Not Liger itself",
    )


@dataclass(kw_only=True)
class SupervisedRun(RunConfig):
    """The configs every supervised run has. Each trainer's run adds its own: ``data`` (its data config,
    which its recipe's ``load_samples`` reads), the configs of its loss or frozen models, and its
    ``ckpt`` default (``trainer_checkpoints("<kind>")``). Only ``model`` and ``datasets`` have
    required flags; every default is here or in the trainer's run, and its command reads them."""

    model: ModelConfig = config_field()
    datasets: DatasetConfig = config_field()
    train: TrainConfig = config_field(TrainConfig)
    optim: OptimConfig = config_field(OptimConfig)
    ckpt: CheckpointConfig = config_field(CheckpointConfig)
    logging: LoggingConfig = config_field(LoggingConfig)
    dist: DistributedConfig = config_field(DistributedConfig)
    run_dir: str | None = None  # metrics and the run config (default: <save_path>/run)

    def problems(self, world: World | None = None) -> list[str]:
        return super().problems(world) + ring_problems(self, world)

    def cross_problems(self, world: World | None = None) -> list[str]:
        if world is None:
            return []
        from tidal.distributed.tensor_parallel import model_layout_problems  # imports torch

        tp, size = self.dist.ds_tensor_parallel_size, world.world_size
        # the batch is split over the data-parallel groups (size // tp), once tp divides the world
        return model_layout_problems(tp, size, {"--pretrain": self.model}) + (
            self.train.batch_problems(size // tp) if size % tp == 0 else []
        )


def ring_problems(run: SupervisedRun, world: World | None = None) -> list[str]:
    """One line per reason ``--ring_attn_size`` cannot run for this trainer, these flags and world."""
    size = run.dist.ring_attn_size
    if size <= 1:
        return []
    problems = []  # every supervised trainer runs under ring attention (docs/distributed.md)
    if not run.train.packing_samples:
        problems.append(
            f"--ring_attn_size {size} needs --packing_samples (ring attention splits packed rows)"
        )
    if run.model.aux_loss_coef > 0:
        problems.append(
            f"--ring_attn_size {size} with --aux_loss_coef {run.model.aux_loss_coef}: the MoE load-balancing "
            "loss of a sequence split over ranks is not supported; set --aux_loss_coef 0"
        )
    return problems + (ring_layout_problems(size, world.world_size) if world is not None else [])


def trainer_kind(run) -> str:
    """``sft``, ``dpo``, ``kto``... from the run's class (``SFTRun``), recorded in its checkpoints."""
    return type(run).__name__.removesuffix("Run").lower()


@dataclass(kw_only=True)
class SFTRun(SupervisedRun):
    """Everything an SFT run is configured by: the common configs and its data."""

    data: SFTDataConfig = config_field(lambda: SFTDataConfig(input_template=OPENRLHF_INPUT_TEMPLATE))
    vision: VisionConfig = config_field(VisionConfig)
    train: TrainConfig = config_field(lambda: TrainConfig(max_epochs=2))  # OpenRLHF's train_sft default
    ckpt: CheckpointConfig = config_field(trainer_checkpoints("sft"))


@dataclass
class RMConfig:
    """Reward model: pairwise loss, value head name and reward normalisation."""

    loss: str = arg("sigmoid", help="pairwise loss", choices=RM_LOSS_NAMES)
    margin_loss: bool = arg(
        False,
        help="subtract each pair's 'margin' (a number every row must have) in the sigmoid loss: "
        "-log sigmoid(r_chosen - r_rejected - margin)",
    )
    compute_fp32_loss: bool = arg(
        False, help="compute the loss on float32 rewards (default: in the --param_dtype compute dtype)"
    )
    value_head_prefix: str = arg(
        "score", help="attribute name of the value head (score: HF's name)", aliases=["--value_prefix_head"]
    )
    normalize_reward: bool = arg(
        False, help="store the reward mean/std (eval set, else train set) in the saved config"
    )


@dataclass(kw_only=True)
class RMRun(SupervisedRun):
    """Everything a reward-model run is configured by: the common configs, its pairs and head."""

    train: TrainConfig = config_field(lambda: TrainConfig(micro_train_batch_size=1))  # OpenRLHF's train_rm
    optim: OptimConfig = config_field(lambda: OptimConfig(learning_rate=9e-6))
    data: PairDataConfig = config_field(PairDataConfig)
    vision: VisionConfig = config_field(VisionConfig)
    rm: RMConfig = config_field(RMConfig)
    ckpt: CheckpointConfig = config_field(trainer_checkpoints("rm"))

    def cross_problems(self, world: World | None = None) -> list[str]:
        problems = super().cross_problems(world)
        if self.model.aux_loss_coef > 0:
            problems.append("--aux_loss_coef: the MoE load-balancing loss is not supported for reward models")
        if self.rm.margin_loss and self.rm.loss != "sigmoid":
            problems.append(
                f"--margin_loss with --loss {self.rm.loss}: only the sigmoid loss has a margin term; "
                "use --loss sigmoid or drop --margin_loss"
            )
        if self.rm.normalize_reward and self.model.lora_rank > 0:
            problems.append(
                "--normalize_reward with --lora_rank: LoRA runs save adapters only, which cannot carry the "
                "reward mean/std; merge the adapters (tidal lora_combiner) and train without LoRA, or drop one"
            )
        return problems


@dataclass(kw_only=True)
class PRMRun(SupervisedRun):
    """Everything a PRM run is configured by: the common configs and its data."""

    datasets: HeldOutDatasetConfig = config_field()
    train: TrainConfig = config_field(lambda: TrainConfig(micro_train_batch_size=1))  # OpenRLHF's train_prm
    optim: OptimConfig = config_field(lambda: OptimConfig(learning_rate=1e-6))
    data: PRMDataConfig = config_field(PRMDataConfig)
    ckpt: CheckpointConfig = config_field(trainer_checkpoints("prm"))
    kernels: FusedHeadConfig = config_field(FusedHeadConfig)

    def cross_problems(self, world: World | None = None) -> list[str]:
        problems = super().cross_problems(world)
        if self.model.aux_loss_coef > 0:
            problems.append("--aux_loss_coef: the MoE load-balancing loss is not supported for PRM training")
        return problems


@dataclass
class DPOConfig(Checked):
    """DPO-family loss: β, the IPO variant, cDPO label smoothing and the NLL term."""

    beta: float = arg(0.1, help="β: strength of the implicit KL constraint to the reference")
    ipo: bool = arg(False, help="use the IPO loss (z − 1/(2β))² instead of the sigmoid DPO loss")
    label_smoothing: float = arg(
        0.0, help="cDPO: assumed probability that a preference label is flipped (0 ≤ ls < 0.5)"
    )
    nll_loss_coef: float = arg(0.0, help="weight of the NLL loss on the chosen responses' tokens")

    def problems(self, flags=None) -> list[str]:
        own = []
        if self.beta <= 0:
            own.append(f"--beta must be positive, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            own.append(f"--label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.ipo and self.label_smoothing > 0:
            own.append("--label_smoothing (cDPO) applies to the sigmoid DPO loss, not to --ipo")
        if self.nll_loss_coef < 0:
            own.append(f"--nll_loss_coef must be >= 0, got {self.nll_loss_coef}")
        return super().problems(flags) + own

    @property
    def loss_name(self) -> str:
        return "ipo" if self.ipo else "sigmoid"


@dataclass(kw_only=True)
class DPORun(SupervisedRun):
    """Everything a DPO run is configured by: the common configs, its pairs, loss and reference."""

    datasets: HeldOutDatasetConfig = config_field()
    optim: OptimConfig = config_field(lambda: OptimConfig(learning_rate=1e-5))  # OpenRLHF's train_dpo
    data: PairDataConfig = config_field(PairDataConfig)
    vision: VisionConfig = config_field(VisionConfig)
    dpo: DPOConfig = config_field(DPOConfig)
    ref: ReferenceConfig = config_field(ReferenceConfig)
    ckpt: CheckpointConfig = config_field(trainer_checkpoints("dpo"))


@dataclass
class KTOConfig(Checked):
    """KTO loss: β and the weights of desirable and undesirable samples."""

    beta: float = arg(0.01, help="β: how sharply the loss saturates around the KL reference point")
    desirable_loss_weight: float = arg(1.0, help="w_d: weight of desirable samples' loss")
    undesirable_loss_weight: float = arg(1.0, help="w_u: weight of undesirable samples' loss")

    def problems(self, flags=None) -> list[str]:
        own = []
        if self.beta <= 0:
            own.append(f"--beta must be positive, got {self.beta}")
        if self.desirable_loss_weight < 0 or self.undesirable_loss_weight < 0:
            own.append("--desirable_loss_weight and --undesirable_loss_weight must be >= 0")
        return super().problems(flags) + own


@dataclass(kw_only=True)
class KTORun(SupervisedRun):
    """Everything a KTO run is configured by: the common configs, its samples, loss and reference."""

    datasets: HeldOutDatasetConfig = config_field()
    optim: OptimConfig = config_field(lambda: OptimConfig(learning_rate=1e-5))  # OpenRLHF's train_kto
    data: UnpairedDataConfig = config_field(
        lambda: UnpairedDataConfig(input_template=OPENRLHF_INPUT_TEMPLATE)
    )
    kto: KTOConfig = config_field(KTOConfig)
    ref: ReferenceConfig = config_field(ReferenceConfig)
    ckpt: CheckpointConfig = config_field(trainer_checkpoints("kto"))

    def cross_problems(self, world: World | None = None) -> list[str]:
        problems = super().cross_problems(world)
        if world is not None:
            groups = max(world.world_size // self.dist.ds_tensor_parallel_size, 1)  # tp ranks share samples
            if self.train.train_batch_size // groups < 2:
                problems.append(
                    "KTO needs --train_batch_size of at least 2 per device (its KL term pairs samples)"
                )
        return problems


@dataclass
class KDConfig(Checked):
    """Distillation: the teacher and how much its distributions weigh against the labels."""

    teacher_model: str = arg(help="teacher model (HF folder or name); must share the student's tokenizer")
    kd_coef: float = arg(0.4, help="α: weight of the distillation term; the LM loss gets 1 − α")
    teacher_offload: bool = arg(
        False, help="keep the teacher in CPU memory; move it to the device only for its forward"
    )

    def problems(self, flags=None) -> list[str]:
        own = [] if 0.0 <= self.kd_coef <= 1.0 else [f"--kd_coef must be in [0, 1], got {self.kd_coef}"]
        return super().problems(flags) + own


@dataclass(kw_only=True)
class KDRun(SupervisedRun):
    """Everything a distillation run is configured by: the common configs, its SFT data and teacher."""

    datasets: HeldOutDatasetConfig = config_field()
    data: SFTDataConfig = config_field(lambda: SFTDataConfig(input_template=OPENRLHF_INPUT_TEMPLATE))
    kd: KDConfig
    ckpt: CheckpointConfig = config_field(trainer_checkpoints("kd"))
    kernels: FusedHeadConfig = config_field(FusedHeadConfig)
