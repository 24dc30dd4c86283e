"""jaxspec: zero-bubble async scheduling with speculative decoding, in JAX/XLA."""
import importlib

from jaxspec import xla_flags

xla_flags.configure()   # before anything starts JAX's backend

# The public names are imported on first use (PEP 562): the command-line tools live inside this package, and
# they check their arguments before anything imports JAX (a bad flag is answered in a fraction of a second).
_PUBLIC = {
    "LLM": "jaxspec.llm",
    "generate": "jaxspec.llm",
    "load_model": "jaxspec.models.loader",
    "SamplingParams": "jaxspec.sampling_params",
    "RequestOutput": "jaxspec.sched.output",
    "SpeculativeConfig": "jaxspec.spec",
    "StructuredOutputsParams": "jaxspec.structured",
    "LoRARequest": "jaxspec.lora",
}


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
    elif not name.startswith("__"):   # a submodule (jaxspec.sched, jaxspec.models, ...), as an eager import gave
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))


def train_eagle3(model, out_dir, **kwargs):
    """Train an EAGLE-3 head for `model` (see jaxspec.train.train_eagle3)."""
    from jaxspec.train import train_eagle3 as train
    return train(model, out_dir, **kwargs)


def train_draft(model, out_dir, **kwargs):
    """Train a parallel draft model (PARD) from `model`, a small model of the target's tokenizer (see
    jaxspec.train.train_draft)."""
    from jaxspec.train import train_draft as train
    return train(model, out_dir, **kwargs)


__all__ = ["train_eagle3", "train_draft", "LLM", "SamplingParams", "SpeculativeConfig", "StructuredOutputsParams", "RequestOutput", "generate", "load_model"]
__version__ = "0.1.0"
