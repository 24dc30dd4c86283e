"""jaxspec: zero-bubble async scheduling with speculative decoding, in JAX/XLA."""
from jaxspec import xla_flags

xla_flags.configure()   # before anything starts JAX's backend

from jaxspec.llm import LLM, generate
from jaxspec.models.loader import load_model
from jaxspec.sampling_params import SamplingParams
from jaxspec.sched.output import RequestOutput
from jaxspec.spec import SpeculativeConfig
from jaxspec.structured import StructuredOutputsParams



def train_eagle3(model, out_dir, **kwargs):
    """Train an EAGLE-3 head for `model` (see jaxspec.train.train_eagle3)."""
    from jaxspec.train import train_eagle3 as train
    return train(model, out_dir, **kwargs)


__all__ = ["train_eagle3", "LLM", "SamplingParams", "SpeculativeConfig", "StructuredOutputsParams", "RequestOutput", "generate", "load_model"]
__version__ = "0.1.0"
