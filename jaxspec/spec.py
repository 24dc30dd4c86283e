"""`SpeculativeConfig` and the drafter it builds."""
from __future__ import annotations

import dataclasses

METHODS = ("draft_model", "eagle", "eagle3", "mtp", "ngram")
MAX_SPEC_TOKENS = 16


@dataclasses.dataclass
class SpeculativeConfig:
    method: str
    model: object = None                # draft model / EAGLE head: a preset, GGUF file, directory or Model;
                                        # mtp: None (the target's own checkpoint), a directory with mtp.*
                                        # tensors, or the head's declared params (a dict)
    num_speculative_tokens: int = 4
    draft_sampling: str = "argmax"      # "argmax": drafts are the drafter's argmax (q is a point mass)
    prompt_lookup_min: int = 2          # ngram: shortest suffix matched against the history
    prompt_lookup_max: int = 4          # ngram: longest suffix tried first
    # The host picks k in 0..num_speculative_tokens for each step from the running per-position acceptance
    # and the device time of each compiled k's step (jaxspec.sched.adaptive); False: every step drafts k.
    adaptive: bool = False
    # A draft model's placement under tensor parallelism (vLLM's field of the same name): 1 keeps it whole on every
    # device, which runs its forwards with no all-reduce (split, each of its k forwards per step pays two per
    # layer); the engine's tensor_parallel_size splits it over the devices as the target is. None (unset): the
    # faster of the two for a draft model, by its size against its all-reduces (jaxspec.decode.drafters.placement
    # draft_runs_whole: a 1B draft whole, an 8B one split; vLLM always splits it), split for the heads, which read
    # the target's split embedding and lm_head.
    draft_tensor_parallel_size: int | None = None
    # draft_model: propose drafts 2..k in one forward over k-1 mask tokens appended after the row's last token (a
    # parallel draft model, PARD's recipe: docs/parallel_drafting.md) instead of k-1 forwards one after another.
    # mask_token_id: the token those positions carry (None: the draft model's config.json `pard_token`).
    parallel_drafting: bool = False
    mask_token_id: int | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is unknown; choose one of {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPEC_TOKENS:
            raise ValueError(f"num_speculative_tokens={k!r} is invalid; it must be an int in [1, {MAX_SPEC_TOKENS}]")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive={self.adaptive!r} is invalid; it must be True or False")
        d = self.draft_tensor_parallel_size
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"draft_tensor_parallel_size={d!r} is invalid; give 1 (the draft model whole on every "
                             "device) or the engine's tensor_parallel_size, or leave it unset")
        if self.draft_sampling not in ("argmax", "sample"):
            raise ValueError(f"draft_sampling={self.draft_sampling!r} is invalid; choose 'argmax' or 'sample'")
        if self.method == "ngram":
            lookup = (self.prompt_lookup_min, self.prompt_lookup_max)
            if not all(isinstance(n, int) and not isinstance(n, bool) for n in lookup) or not 1 <= lookup[0] <= lookup[1]:
                raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min} and prompt_lookup_max="
                                 f"{self.prompt_lookup_max} are invalid; need 1 <= min <= max")
            if self.draft_sampling != "argmax":
                raise ValueError("ngram drafts are copied from the history: draft_sampling must be 'argmax'")
        elif self.model is None and self.method != "mtp":
            raise ValueError(f"speculative method {self.method!r} needs `model` (the draft model or head)")
        if (self.parallel_drafting or self.mask_token_id is not None) and self.method != "draft_model":
            raise ValueError(f"parallel_drafting and mask_token_id are draft_model's; method {self.method!r} takes "
                             "neither")
        m = self.mask_token_id
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 0):
            raise ValueError(f"mask_token_id={m!r} is invalid; give a token id (an int >= 0)")

    @classmethod
    def coerce(cls, value) -> "SpeculativeConfig | None":
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise ValueError(f"unknown speculative_config keys {sorted(unknown)}; valid: "
                                 f"{[f.name for f in dataclasses.fields(cls)]}")
            return cls(**value)
        raise ValueError(f"speculative_config must be a SpeculativeConfig or a dict, got {type(value).__name__}")


def build_drafter(spec: SpeculativeConfig, target, quantization: str | None = None, tensor_parallel_size: int = 1):
    """-> (drafter, drafter_params) for the engine's step: its params quantized as `quantization` says (a draft model
    from a quantized checkpoint is taken as it is) and the drafter placed for `tensor_parallel_size` devices
    (jaxspec.decode.drafters.placement). The drafter does not keep the number of drafts: the engine puts
    `spec.num_speculative_tokens` into its StepConfig, where the step reads it. Heads are quantized here, at serving
    only: training (jaxspec.train) builds unquantized heads."""
    from jaxspec.decode.drafters.placement import whole_on_each_device
    drafter, params = _loaded_drafter(spec, target)
    if quantization is not None and params is not None:   # n-gram has no weights
        from jaxspec.nn import quant
        if not quant.quantized_names(params):
            params = quant.quantize_params(params)
    whole = whole_on_each_device(spec, tensor_parallel_size, drafter, params)   # on the bytes it will read
    return drafter.configured(quantization if params is not None else None, whole), params


def _loaded_drafter(spec: SpeculativeConfig, target):
    """(drafter, params) as the method's files or model give them: unquantized, unplaced."""
    if spec.method == "ngram":
        from jaxspec.decode.drafters.ngram import NgramDrafter
        return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max), None
    if spec.method == "draft_model":
        from jaxspec.decode.drafters.draft_model import build_draft_model_drafter
        return build_draft_model_drafter(spec, target)
    if spec.method == "mtp":
        from jaxspec.decode.drafters.mtp import build_mtp_drafter
        return build_mtp_drafter(spec, target)
    from jaxspec.decode.drafters.eagle import build_eagle_drafter
    return build_eagle_drafter(spec, target)
