"""`TrainConfig`: an EAGLE-3 training run's settings, and `PardConfig` a parallel draft model's, checked once. Apart
from the training code (which imports JAX) so that `jaxspec-train-eagle` and `jaxspec-train-draft` check their flags
with them before loading anything."""
from __future__ import annotations

import dataclasses


ARCHS = ("chain", "parallel")


@dataclasses.dataclass
class TrainConfig:
    steps: int = 2000
    batch_size: int = 8
    learning_rate: float = 3e-4
    warmup_steps: int = 100
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    ttt_steps: int = 7              # draft steps unrolled per position (the training-time test)
    step_decay: float = 0.8         # weight of step j's loss: step_decay ** j
    draft_vocab_size: int = 32000
    save_every: int = 500           # orbax checkpoint interval (steps); the last step is always saved
    seed: int = 0
    # Run the target over every training example once and keep its outputs in device memory (never on disk):
    # for small datasets trained for many epochs (CPU runs); off, the target runs inside every training step.
    cache_target_outputs: bool = False
    # Wall-clock budget of the training loop in seconds (set-up and the held-out estimate excluded): after the
    # first steps have been timed, `steps` is cut to what fits and the schedule decays over the cut count.
    max_seconds: float | None = None
    # The head's matmuls in training: "auto" is bfloat16 on a GPU (f32 master weights and optimizer state) and
    # float32 elsewhere.
    compute_dtype: str = "auto"
    # "chain": each draft step reads the previous one's token and hidden (EAGLE-3); "parallel": one forward
    # proposes all k drafts, steps after the first reading learned placeholders (docs/parallel_drafting.md)
    arch: str = "chain"
    # Several examples end to end in each row (Examples.pack): fewer padded tokens per step; attention, positions
    # and predictions stay within each example
    pack: bool = False

    def __post_init__(self):
        check_run(self, ("ttt_steps", "draft_vocab_size"))
        if self.arch not in ARCHS:
            raise ValueError(f"arch={self.arch!r} is invalid; use one of {', '.join(map(repr, ARCHS))}")


def check_run(config, counts: tuple[str, ...] = ()):
    """The settings every training run has (TrainConfig, PardConfig): steps, batch_size, save_every and the
    `counts` named >= 1, warmup_steps >= 0, learning_rate in (0, 1), max_seconds positive or None."""
    for name in ("steps", "batch_size", "save_every", *counts):
        if int(getattr(config, name)) < 1:
            raise ValueError(f"{name}={getattr(config, name)!r} is invalid; it must be >= 1")
    if int(config.warmup_steps) < 0:
        raise ValueError(f"warmup_steps={config.warmup_steps!r} is invalid; it must be >= 0")
    if not 0 < config.learning_rate < 1:
        raise ValueError(f"learning_rate={config.learning_rate!r} is invalid; use a value in (0, 1)")
    if config.max_seconds is not None and not config.max_seconds > 0:
        raise ValueError(f"max_seconds={config.max_seconds!r} is invalid; use a positive number or None")


@dataclasses.dataclass
class PardConfig:
    """A parallel draft model's training run (jaxspec.train.pard): the draft model's every weight trained to fill
    mask tokens, checked once (apart from the training code, for `jaxspec-train-draft`'s flags)."""
    steps: int = 2000
    batch_size: int = 8
    learning_rate: float = 3e-5
    warmup_steps: int = 100
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    num_drafts: int = 4             # k: drafts 1..k trained (draft 1 the next token, drafts 2..k from k-1 masks)
    step_decay: float = 0.8         # weight of draft j+1's loss: step_decay ** j
    save_every: int = 500           # orbax checkpoint interval (steps); the last step is always saved
    seed: int = 0
    # Wall-clock budget of the training loop in seconds, as TrainConfig.max_seconds.
    max_seconds: float | None = None
    # The model's matmuls in training: "auto" is bfloat16 on a GPU (f32 master weights and optimizer state) and
    # float32 elsewhere.
    compute_dtype: str = "auto"
    # Several examples end to end in each row (Examples.pack), as TrainConfig.pack.
    pack: bool = True
    # The mask token's id; None: the first id past the tokenizer's that the embedding has a row for
    # (jaxspec.train.pard.default_mask_token).
    mask_token_id: int | None = None

    def __post_init__(self):
        check_run(self)
        if int(self.num_drafts) < 2:
            raise ValueError(f"num_drafts={self.num_drafts!r} is invalid; a parallel draft model proposes at least "
                             "2 drafts (the first from the sequence, the rest from mask tokens)")
        if not 0 < self.step_decay <= 1:
            raise ValueError(f"step_decay={self.step_decay!r} is invalid; use a value in (0, 1]")
        if self.mask_token_id is not None and int(self.mask_token_id) < 0:
            raise ValueError(f"mask_token_id={self.mask_token_id!r} is invalid; it must be >= 0")
        if self.compute_dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"compute_dtype={self.compute_dtype!r} is invalid; use auto, bfloat16, float16 or "
                             "float32")
