"""EAGLE-3's own ``drafter.*`` keys (torch-free: parse time checks them); the keys every kind trains with are
aerie.drafter.config.TrainConfig's."""

from __future__ import annotations

from dataclasses import dataclass

ATTENTION_KINDS = ("auto", "llama", "mla")
ATTENTION_KERNELS = ("auto", "chunked", "flex")  # aerie.drafter_kinds.eagle3.layers.attention_kernel resolves auto


@dataclass(frozen=True)
class Eagle3Settings:
    ttt_steps: int = 7  # unrolled draft steps per position (EAGLE-3 uses 7)
    step_loss_decay: float = 0.8  # weight of step k is decay**k
    attention_kernel: str = "auto"  # TTT attention: auto (flex on CUDA, chunked elsewhere), chunked or flex
    mask_out_of_vocab_targets: bool = True  # skip positions whose target argmax is outside the draft vocab
    init_head_from_target: bool = True  # start lm_head and norm from the target's (its draft-vocab rows)
    # the drafter's shape (SGLang serves both attention kinds); 0 = derived from the target
    attention: str = "auto"  # llama or mla (SGLang serves both); auto = mla for MLA targets (Kimi K2.5), else llama
    num_attention_heads: int = 0  # 0 = the target's (llama on an MLA target: hidden_size / 128)
    num_key_value_heads: int = 0  # llama only; 0 = the target's (8 on an MLA target)
    head_dim: int = 0  # llama only; 0 = the target's (128 on an MLA target)
    intermediate_size: int = 0  # the drafter's MLP width; 0 = the target's
    fc_norm: bool = False  # EAGLE-3.1: one RMSNorm per aux layer before fc
    norm_output: bool = False  # EAGLE-3.1: the next draft step reads the post-norm hidden state

    def __post_init__(self) -> None:
        if self.ttt_steps < 1:
            raise ValueError(f"drafter.ttt_steps must be at least 1, not {self.ttt_steps}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(
                f"drafter.attention_kernel must be one of {', '.join(ATTENTION_KERNELS)}, not {self.attention_kernel!r}"
            )
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"drafter.attention must be one of {', '.join(ATTENTION_KINDS)}, not {self.attention!r}")
        for name in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"drafter.{name} must be >= 0 (0 = derived from the target), not {getattr(self, name)}"
                )

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

    def shape_overrides(self) -> dict:
        """Only the shape settings that differ from "derived from the target"."""
        return {k: v for k, v in self.drafter_shape().items() if v not in (None, False, "auto")}
