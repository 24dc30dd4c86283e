"""The same workload through another engine, for the side-by-side: vLLM (`vllm`) and transformers (`hf`)."""
