"""DFlash's own ``drafter.*`` keys (torch-free: parse time checks them); the keys every kind trains with are
aerie.drafter.config.TrainConfig's."""

from __future__ import annotations

from dataclasses import dataclass

ATTENTION_KERNELS = ("auto", "reference", "flex")  # auto: flex on CUDA, the dense reference mask elsewhere
DEFAULT_NUM_LAYERS = 6  # z-lab's Kimi-K2.5-DFlash
DEFAULT_BLOCK_SIZE = 8  # z-lab's Kimi-K2.5-DFlash


@dataclass(frozen=True)
class DFlashSettings:
    # 0 / -1 / () below: derived - from the warm-start folder (drafter.init), else as stated
    num_layers: int = 0  # the draft's decoder layers; 0 = 6 (z-lab's Kimi-K2.5-DFlash)
    block_size: int = 0  # one anchor + block_size - 1 drafts per forward, SGLang's verify window; 0 = 8 (z-lab's)
    num_anchors: int = 512  # blocks sampled per sequence per step (SpecForge's default)
    loss_gamma: float = 0.0  # per-slot decay exp(-(k-1)/gamma); 0 = the paper's for the block size (4 for 8)
    mask_token_id: int = -1  # -1 = the target tokenizer's <|MASK|>, else its unk token (Kimi K2.5: 163838 [UNK])
    target_layer_ids: tuple[int, ...] = ()  # the target layers it reads; () = SGLang 0.5.23's default for the depth
    num_attention_heads: int = 0  # 0 = the target's
    num_key_value_heads: int = 0  # 0 = the target's (8 on an MLA target)
    head_dim: int = 0  # 0 = the target's (128 on an MLA target)
    intermediate_size: int = 0  # the draft layers' MLP width; 0 = the target's
    sliding_window: int = 0  # > 0: every draft layer slides over this many keys (SGLang's sliding_attention)
    attention_kernel: str = "auto"  # auto (flex on CUDA, reference elsewhere), reference or flex
    checkpoint_layers: bool = False  # recompute each draft layer in backward (memory for time)

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if self.num_anchors < 1:
            raise ValueError(f"drafter.num_anchors must be at least 1, not {self.num_anchors}")
        if self.num_layers < 0:
            raise ValueError(f"drafter.num_layers must be >= 1 (0 = derived), not {self.num_layers}")
        if self.block_size and self.block_size < 2:
            raise ValueError(
                f"drafter.block_size must be >= 2, not {self.block_size}: slot 0 is the last verified token, "
                "slots 1..block_size-1 are the drafts"
            )
        if self.loss_gamma < 0:
            raise ValueError(f"drafter.loss_gamma must be >= 0 (0 = the block size's default), not {self.loss_gamma}")
        if self.mask_token_id < -1:
            raise ValueError(
                f"drafter.mask_token_id must be a token id or -1 (the tokenizer's), not {self.mask_token_id}"
            )
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(
                f"drafter.attention_kernel must be one of {', '.join(ATTENTION_KERNELS)}, not {self.attention_kernel!r}"
            )
        for name in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "sliding_window"):
            if getattr(self, name) < 0:
                raise ValueError(f"drafter.{name} must be >= 0 (0 = derived), not {getattr(self, name)}")

    @property
    def layers(self) -> int:
        """The draft's decoder layers: drafter.num_layers, else the default."""
        return self.num_layers or DEFAULT_NUM_LAYERS

    @property
    def block(self) -> int:
        """The block size: drafter.block_size, else the default."""
        return self.block_size or DEFAULT_BLOCK_SIZE

    @property
    def gamma(self) -> float | None:
        """The loss decay as the objective takes it (None: the block size's default)."""
        return self.loss_gamma or None
