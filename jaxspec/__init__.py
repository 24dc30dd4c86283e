"""jaxspec: zero-bubble async scheduling with speculative decoding, in JAX/XLA."""
from jaxspec.llm import LLM, generate
from jaxspec.models.loader import load_model
from jaxspec.sampling_params import SamplingParams
from jaxspec.sched.output import RequestOutput
from jaxspec.spec import SpeculativeConfig

__all__ = ["LLM", "SamplingParams", "SpeculativeConfig", "RequestOutput", "generate", "load_model"]
__version__ = "0.1.0"
