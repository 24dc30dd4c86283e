#!/usr/bin/env bash
# Fetches the wheels that vLLM 0.26.0 needs on the GPU machine and that the machine does not already
# have at a usable version, into DIR (default .whl-vllm026). Everything else -- torch 2.11.0+cu130,
# torchvision 0.26.0, torchaudio 2.11.0, triton 3.6.0, transformers, tokenizers, numpy, aiohttp, ... --
# is taken from the machine's own Python as it is. vllm 0.26.0 pins torch==2.11.0,
# torchaudio==2.11.0 and torchvision==0.26.0, which are exactly the machine's versions.
# The pins come from vllm 0.26.0's wheel METADATA and, recursively, from each added package's own
# Requires-Dist (Python 3.12, linux x86_64 markers, no optional extras except the ones vLLM asks for:
# fastapi[standard], mistral_common[image], nvidia-cutlass-dsl[cu13], humming-kernels[cu13]).
# Where several versions fit, the one from the vLLM 0.23.0 set (../shared/tools/vllm_wheels.sh) is kept,
# else the newest that fits. One version of each package; 114 wheels, about 900 MB.
#
# Usage, from the project root:
#   bash benchmarks/vllm_wheels_026.sh [DIR]
#   python3 ../shared/tools/device_stage.py pack DIR --name vllm-wheels --chunk-mib 56
#       (writes .stage/NNN chunks and prints the device calls; the last call unpacks the wheels to
#        /tmp/models/vllm-wheels/ on the GPU machine; make the calls back to back while it is warm)
#   on the GPU machine, then:
#       python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vllm-site \
#           /tmp/models/vllm-wheels/*.whl
#   and start vLLM with:
#       PYTHONPATH=/tmp/vllm-site:/tmp/vllm-site/nvidia_cutlass_dsl/dsl_packages \
#           VLLM_USE_FLASHINFER_SAMPLER=0 python3 ...
#   The second PYTHONPATH entry stands in for nvidia_cutlass_dsl_packages.pth, which only a real
#   site-packages folder would run (a --target folder on PYTHONPATH does not), so that `import cutlass`
#   (the CuTe DSL that quack-kernels and tokenspeed-mla use) works.
#   pynvvideocodec also drops top-level benchmarks/ and samples/ folders into the target; they are
#   harmless data, but `rm -rf /tmp/vllm-site/benchmarks /tmp/vllm-site/samples` keeps them from
#   mixing into this project's own `benchmarks` namespace.
#
# Left out on purpose: flashinfer-python==0.6.14 (a hard requirement of vllm 0.26.0, but large; as with
# the 0.23 set it is not carried, and VLLM_USE_FLASHINFER_SAMPLER=0 keeps sampling in native torch), and
# cuda-tile, which only flashinfer-python pulls in.
# Carried although the machine has the package, because its version there does not fit the metadata;
# the copy under /tmp/vllm-site shadows the machine's one for vLLM's process only:
#   numba 0.65.0 + llvmlite 0.47.0 (vllm pins numba==0.65.0; machine: 0.68.0 / 0.50.0),
#   protobuf 6.33.6 (nvidia-cutlass-dsl-libs need <7; machine: 7.36.2),
#   setuptools 80.10.2 (vllm needs <81 on Python 3.12; machine: 81.0.0),
#   cuda-bindings 13.4.4 (cuda-python 13.4.4, needed by the cutlass DSL, wants ~=13.4.4; machine: 13.3.1).
# NOT carried although the metadata asks for less: numpy. numba 0.65.0 wants numpy<2.5 and
# mistral_common 1.13.1 wants numpy<2.4; the machine has numpy 2.5.2 and keeps it (as with the 0.23 set),
# so `import numba` fails there ("Numba needs NumPy 2.4 or less"): vLLM imports numba only lazily
# (CPU n-gram speculative decoding, a few multimodal processors). Add numpy==2.3.5 to the list below
# if those paths are needed.
# humming-kernels[cu13] asks for an unpinned CUDA compiler; nvidia-cuda-nvcc/nvvm/crt 13.0.88 and
# nvidia-cuda-cccl 13.0.85 are chosen to match the machine's CUDA 13.0 runtime and driver.
# LEAN=1 then removes ~470 MB that a dense or MoE model with bf16 weights on an H100 never imports (vLLM imports
# each lazily, on its own path): tokenspeed-triton and tilelang + z3 (MLA and DeepSeek kernels), the cutlass DSL's
# CUDA 12 libraries (the machine runs CUDA 13), the CUDA compiler nvcc + nvvm (humming-kernels' JIT, for its
# quantized kernels), pynvvideocodec and torchcodec (video inputs), numba + llvmlite (which fail to import beside the
# machine's numpy anyway). 453 MB are left: 9 staging calls (--chunk-mib 56, which leaves room for the tree) instead
# of 16. vLLM 0.26 ran Gemma-3-12B, GPT-OSS-20B and Qwen3-30B-A3B from it (docs/lab/2026-11-27-moe-routing-vllm.md).
set -euo pipefail
DIR=${1:-.whl-vllm026}
mkdir -p "$DIR"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_5_x86_64 \
  --platform manylinux1_x86_64 -d "$DIR" \
  agent_detector==2.0.0 \
  annotated_types==0.8.0 \
  anthropic==2.12.0 \
  apache_tvm_ffi==0.1.10 \
  astor==0.8.1 \
  blake3==1.0.11 \
  cachetools==8.0.1 \
  cbor2==6.3.0 \
  cffi==2.1.1 \
  compressed_tensors==0.17.0 \
  cryptography==50.0.2 \
  cuda_bindings==13.4.4 \
  cuda_python==13.4.4 \
  depyf==0.20.0 \
  detect_installer==0.2.1 \
  dill==0.4.1 \
  dnspython==2.9.2 \
  docstring_parser==0.18.0 \
  email_validator==2.4.0 \
  fastapi_cli==0.0.34 \
  fastapi_cloud_cli==0.28.0 \
  fastapi==0.136.3 \
  fastar==0.12.0 \
  fastsafetensors==0.5.0 \
  googleapis_common_protos==1.76.0 \
  httpcore2==2.16.2 \
  httptools==0.9.0 \
  httpx2==2.16.2 \
  humming_kernels==0.1.10 \
  ijson==3.6.0 \
  interegular==0.3.3 \
  jiter==0.19.0 \
  jmespath==1.1.0 \
  jsonschema_specifications==2025.9.1 \
  jsonschema==4.26.0 \
  lark==1.2.2 \
  llguidance==1.7.6 \
  llvmlite==0.47.0 \
  lm_format_enforcer==0.11.3 \
  loguru==0.7.3 \
  mcp_types==2.3.0 \
  mcp==2.3.0 \
  mistral_common==1.13.1 \
  model_hosting_container_standards==0.1.16 \
  msgspec==0.22.0 \
  numba==0.65.0 \
  nvidia_cuda_cccl==13.0.85 \
  nvidia_cuda_crt==13.0.88 \
  nvidia_cuda_nvcc==13.0.88 \
  nvidia_cuda_nvdisasm==13.5.37 \
  nvidia_cudnn_frontend==1.28.0 \
  nvidia_cutlass_dsl_libs_base==4.6.0 \
  nvidia_cutlass_dsl_libs_core==4.6.0 \
  nvidia_cutlass_dsl_libs_cu12==4.6.0 \
  nvidia_cutlass_dsl_libs_cu13==4.6.0 \
  nvidia_cutlass_dsl==4.6.0 \
  nvidia_nvvm==13.0.88 \
  nvtx==0.2.15 \
  openai_harmony==0.0.8 \
  openai==3.54.0 \
  opentelemetry_api==1.45.2 \
  opentelemetry_exporter_http_transport==0.66b2 \
  opentelemetry_exporter_otlp_common==0.66b2 \
  opentelemetry_exporter_otlp_proto_common==1.45.2 \
  opentelemetry_exporter_otlp_proto_grpc==1.45.2 \
  opentelemetry_exporter_otlp_proto_http==1.45.2 \
  opentelemetry_exporter_otlp==1.45.2 \
  opentelemetry_proto==1.45.2 \
  opentelemetry_sdk==1.45.2 \
  opentelemetry_semantic_conventions_ai==0.5.1 \
  opentelemetry_semantic_conventions==0.66b2 \
  outlines_core==0.2.14 \
  partial_json_parser==0.2.1.1.post7 \
  prometheus_fastapi_instrumentator==8.1.0 \
  protobuf==6.33.6 \
  pybase64==1.5.1 \
  pycountry==26.2.16 \
  pycparser==3.12 \
  pydantic_core==2.50.4 \
  pydantic_extra_types==2.11.1 \
  pydantic_settings==2.16.3 \
  pydantic==2.14.3 \
  pyelftools==0.33 \
  pyjwt==2.15.1 \
  pynvvideocodec==2.0.4 \
  python_dotenv==1.2.4 \
  python_json_logger==4.2.0 \
  python_multipart==0.0.34 \
  pyzmq==27.3.0 \
  quack_kernels==0.6.3 \
  referencing==0.37.0 \
  rich_toolkit==0.20.6 \
  rignore==0.8.1 \
  rpds_py==2026.9.1 \
  sentry_sdk==2.75.0 \
  setproctitle==1.3.8 \
  setuptools==80.10.2 \
  sniffio==1.3.1 \
  sse_starlette==3.7.0 \
  starlette==1.10.0 \
  supervisor==4.3.0 \
  tilelang==0.1.9 \
  tokenspeed_mla==0.1.8 \
  tokenspeed_triton==3.9.10.post20261028 \
  torch_c_dlpack_ext==0.1.5 \
  torchcodec==0.17.0 \
  truststore==0.10.5 \
  typing_inspection==0.4.5 \
  uvicorn==0.54.0 \
  vllm==0.26.0 \
  watchfiles==1.3.0 \
  websockets==17.4 \
  xgrammar==0.2.7 \
  z3_solver==4.15.4.0 \
  ;
if [ "${LEAN:-0}" = 1 ]; then
  (cd "$DIR" && rm -f tokenspeed_triton-*.whl tilelang-*.whl z3_solver-*.whl nvidia_cutlass_dsl_libs_cu12-*.whl \
    nvidia_cuda_nvcc-*.whl nvidia_nvvm-*.whl pynvvideocodec-*.whl torchcodec-*.whl numba-*.whl llvmlite-*.whl)
fi
ls "$DIR"/*.whl | wc -l; du -sh "$DIR"
