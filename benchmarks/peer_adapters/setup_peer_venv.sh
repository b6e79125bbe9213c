#!/usr/bin/env bash
# Create the Python 3.11 venv in which benchmarks/ledger_bench.py --peers measures vLLM v1's
# KVCacheManager and SGLang's RadixCache on the CPU.
#
#   bash benchmarks/peer_adapters/setup_peer_venv.sh [VENV_DIR]     (default: .venv-peers)
#
# Only the host-side bookkeeping of the two engines is imported, so both packages are installed
# from their PyPI wheels WITHOUT their dependency trees (which pin CUDA builds of torch), next to
# a CPU torch and the pure-Python packages their import chains touch. A constraints file pins
# torch so that nothing below can swap it for a multi-GB CUDA build. CPU torch and torchvision
# come from PyTorch's CPU index (TORCH_INDEX; PyPI's Linux torch is a CUDA build). torchvision is
# optional: SGLang's import chain touches it (an image transform the cache never uses), and the
# SGLang adapter stands in for it when it is absent.
set -euo pipefail
VENV=${1:-.venv-peers}
PYTHON311=${PYTHON311:-python3.11}
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
"$PYTHON311" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' \
  || { echo "need Python 3.11 (set PYTHON311=/path/to/python3.11)"; exit 1; }
"$PYTHON311" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
CONSTRAINTS="$VENV/peer-constraints.txt"
printf 'torch==2.13.0\ntransformers==5.19.0\n' > "$CONSTRAINTS"
"${PIP[@]}" --upgrade pip
# 1. CPU torch (a CUDA build would also run the bookkeeping on the CPU, at several GB).
"${PIP[@]}" -c "$CONSTRAINTS" --extra-index-url "$TORCH_INDEX" torch==2.13.0 numpy
"${PIP[@]}" -c "$CONSTRAINTS" --extra-index-url "$TORCH_INDEX" torchvision==0.28.0 \
  || echo "no CPU torchvision 0.28.0 from $TORCH_INDEX: the SGLang adapter will stand in for it"
# torchvision's CUDA build cannot load against a CPU torch: keep it only if it imports
"$VENV/bin/python" -c 'import torchvision' 2>/dev/null || "$VENV/bin/python" -m pip uninstall -q -y torchvision || true
# 2. the two engines, without their dependency trees
"${PIP[@]}" --no-deps vllm==0.33.0 sglang==0.5.23
# 3. what `import vllm.v1.core.kv_cache_manager` and `import sglang.srt.mem_cache.radix_cache`
#    import on their way (found by importing them in a bare venv, one missing module at a time).
#    pip then reports that sglang's pins (torch 2.14.1, exact tokenizers/xgrammar/...) are not
#    met: expected, the cache's code paths do not depend on them.
"${PIP[@]}" -c "$CONSTRAINTS" \
  packaging psutil pyzmq urllib3 regex msgspec pydantic cbor2 transformers==5.19.0 aiohttp requests \
  openai-harmony openai pillow pybase64 cachetools cloudpickle uvloop py-cpuinfo prometheus_client \
  xgrammar fastapi partial_json_parser llguidance orjson ipython dill sentencepiece \
  compressed-tensors gguf pyyaml
echo "peer venv ready: $VENV/bin/python"
echo "run: python benchmarks/ledger_bench.py --peers --peer-python $VENV/bin/python"
