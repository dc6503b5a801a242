"""The drafter's training settings (the config's ``drafter`` section): torch-free, so parse time can check them."""

from __future__ import annotations

from dataclasses import dataclass

ATTENTION_KINDS = ("auto", "llama", "mla")
LR_SCHEDULES = ("cosine", "constant")
ATTENTION_KERNELS = ("auto", "chunked", "flex")  # aerie.drafter.layers.attention_kernel resolves auto


@dataclass
class TrainConfig:
    ttt_steps: int = 7  # unrolled draft steps per position (EAGLE-3 uses 7)
    step_loss_decay: float = 0.8  # weight of step k is decay**k
    epochs: int = 2  # passes over the training windows; the best epoch (held-out acceptance) is exported
    learning_rate: float = 1e-4  # peak AdamW learning rate (write 0.0001 or 1.0e-4 in YAML: 1e-4 is a string)
    weight_decay: float = 0.0  # applied to matrices only, never to norms
    warmup_ratio: float = 0.03  # share of the optimizer steps with a linear warmup
    min_lr_ratio: float = 0.1  # cosine decays to learning_rate * min_lr_ratio
    grad_clip: float = 0.5  # gradient norm clip (0 = none)
    max_seq_len: int = 2048  # longer sequences are cut into windows of this many rows
    batch_size: int = 4  # windows per optimizer step (per process under torchrun)
    max_batch_tokens: int = 0  # cap on a batch's padded tokens (rows x longest); 0 = batch_size * max_seq_len
    packing: bool = True  # several windows share a batch row of max_seq_len (false: one window per row, padded)
    attention_kernel: str = "auto"  # TTT attention: auto (flex on CUDA, chunked elsewhere), chunked or flex
    eval_fraction: float = 0.05  # held-out share of sequences, chosen by hashing sample ids
    mask_out_of_vocab_targets: bool = True  # skip positions whose target argmax is outside the draft vocab
    init_head_from_target: bool = True  # start lm_head and norm from the target's (its draft-vocab rows)
    seed: int = 0  # drafter init, held-out split and batch order
    threads: int = 0  # torch CPU threads (0 = leave as is)
    log_every: int = 10  # optimizer steps between train_log.jsonl lines
    checkpoint_every: int = 500  # optimizer steps between resumable training states (0 = after epochs only)
    resume: bool = True  # continue from a compatible training state beside out_dir; false = start over
    device: str = "auto"  # auto (CUDA when visible), cpu or cuda
    tensorboard: bool = True  # TensorBoard event files of the training curves (the drafter folder's tensorboard/)
    wandb_project: str = ""  # also log the curves to this Weights & Biases project (needs the wandb package)
    # the drafter's shape (SGLang serves both kinds); 0 = derived from the target
    attention: str = "auto"  # llama or mla (SGLang serves both); auto = mla for MLA targets (Kimi K2.5), else llama
    num_attention_heads: int = 0  # 0 = the target's (llama on an MLA target: hidden_size / 128)
    num_key_value_heads: int = 0  # llama only; 0 = the target's (8 on an MLA target)
    head_dim: int = 0  # llama only; 0 = the target's (128 on an MLA target)
    intermediate_size: int = 0  # the drafter's MLP width; 0 = the target's
    fc_norm: bool = False  # EAGLE-3.1: one RMSNorm per aux layer before fc
    norm_output: bool = False  # EAGLE-3.1: the next draft step reads the post-norm hidden state
    # warm start (aerie.drafter.warm_start): a drafter folder in SGLang's layout, local or a Hub id in the HF cache
    init: str = ""  # "" = train from scratch; else start from every tensor of this folder and keep its draft vocab
    init_pull: float = 0.0  # L2-SP toward the start weights, decoupled: each step w -= lr * init_pull * (w - w_start)
    lr_schedule: str = "cosine"  # after the warmup: cosine to learning_rate * min_lr_ratio, or constant

    def __post_init__(self) -> None:
        for name in ("ttt_steps", "epochs", "batch_size", "max_seq_len", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"drafter.{name} must be at least 1, not {getattr(self, name)}")
        if self.max_batch_tokens < 0:
            raise ValueError(f"drafter.max_batch_tokens must be >= 0 (0 = no cap), not {self.max_batch_tokens}")
        if 0 < self.max_batch_tokens < self.max_seq_len:
            raise ValueError(
                f"drafter.max_batch_tokens ({self.max_batch_tokens}) is below drafter.max_seq_len "
                f"({self.max_seq_len}): one window of max_seq_len rows would not fit a batch; raise max_batch_tokens "
                "or lower max_seq_len"
            )
        if self.checkpoint_every < 0:
            raise ValueError(f"drafter.checkpoint_every must be >= 0, not {self.checkpoint_every}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(
                f"drafter.attention_kernel must be one of {', '.join(ATTENTION_KERNELS)}, not {self.attention_kernel!r}"
            )
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"drafter.attention must be one of {', '.join(ATTENTION_KINDS)}, not {self.attention!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"drafter.lr_schedule must be one of {', '.join(LR_SCHEDULES)}, not {self.lr_schedule!r}")
        if self.init_pull < 0:
            raise ValueError(f"drafter.init_pull must be >= 0 (0 = no pull), not {self.init_pull}")
        if self.init_pull and not self.init:
            raise ValueError("drafter.init_pull pulls toward the start weights of drafter.init, which is not set")
        for name in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"drafter.{name} must be >= 0 (0 = derived from the target), not {getattr(self, name)}"
                )

    @property
    def largest_batch_tokens(self) -> int:
        """The most padded tokens (windows x rows) one batch can hold under these settings."""
        cap = self.batch_size * self.max_seq_len
        return min(cap, self.max_batch_tokens) if self.max_batch_tokens else cap

    def drafter_shape(self) -> dict:
        """The keyword arguments DrafterConfig.from_target takes for the drafter's shape (None = derived)."""
        return {
            "attention": self.attention,
            **{
                name: getattr(self, name) or None
                for name in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
            },
            "fc_norm": self.fc_norm,
            "norm_output": self.norm_output,
        }


# Settings a resumed run may change: they do not alter what is computed.
RESUME_MAY_CHANGE = (
    "threads",
    "log_every",
    "checkpoint_every",
    "resume",
    "device",
    "tensorboard",
    "wandb_project",
    "attention_kernel",
)
