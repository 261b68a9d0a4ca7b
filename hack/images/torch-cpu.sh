#!/bin/sh
# Installs PyPI's torch for CPU serving into the virtual environment $1 (build stage of
# shard_server/Dockerfile), pinned by /src/constraints.txt, without the parts a CPU
# process never loads.
#
# PyPI has only one Linux torch wheel, built for CUDA: libtorch_cuda.so and
# libtorch_python.so are linked against cudart, cuBLAS, cuFFT, cuSPARSE(Lt), cuFile,
# NCCL, cuDNN, NVRTC and NVSHMEM, so `import torch` fails without them (the CPU-only
# wheel lives on another index, which these machines cannot reach). What is left out:
#   * triton (Inductor's GPU compiler), cuSOLVER, NVTX, CCCL headers and the
#     cuda-toolkit/cuda-bindings metadata packages: not linked, never loaded;
#   * from the linked packages, every file the dynamic loader does not load for
#     torch's own libraries (ldd's closure): cuDNN's engine libraries, cuBLAS's
#     static and helper libraries, headers.
# The result is checked at the end: torch imports, multiplies, and has gloo.
#
# Usage: torch-cpu.sh install VENV   torch and the linked CUDA packages only
#        torch-cpu.sh trim VENV      after every other install (a dependency that needs
#                                    torch makes pip add torch's full set back): remove
#                                    what is not loaded, then check torch still works
set -eu
mode="$1"
venv="$2"
pip="$venv/bin/pip"
py="$venv/bin/python"
c=/src/constraints.txt
if [ "$mode" = install ]; then
  "$pip" install -q -c "$c" --no-deps torch
  "$pip" install -q -c "$c" filelock fsspec jinja2 networkx sympy typing_extensions 'setuptools>=77.0.3' \
    nvidia-cuda-runtime nvidia-cublas nvidia-cufft nvidia-cusparse nvidia-nvjitlink \
    nvidia-cufile nvidia-cusparselt-cu13 nvidia-nccl-cu13 nvidia-cudnn-cu13 \
    nvidia-cuda-nvrtc nvidia-nvshmem-cu13 nvidia-cuda-cupti
  exit 0
fi
"$pip" uninstall -q -y triton cuda-toolkit cuda-bindings cuda-pathfinder nvidia-cusolver \
  nvidia-nvtx nvidia-cuda-cccl 2>/dev/null || true
site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
torch_lib="$site/torch/lib"
# torch's CUDA linear algebra (cuSOLVER), dlopen'ed by CUDA linalg calls only.
rm -f "$torch_lib/libtorch_cuda_linalg.so"
lib_path="$(find "$site/nvidia" -type d -name lib | tr '\n' ':')$torch_lib"
keep=/tmp/torch-keep.txt
# Every shared object torch's libraries and extension modules load, resolved.
find "$site/torch" -name '*.so*' -type f | while read -r so; do
  LD_LIBRARY_PATH="$lib_path" ldd "$so" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $3}'
done | sort -u | while read -r lib; do readlink -f "$lib"; done | sort -u >"$keep"
# Unresolved, besides the GPU driver (libcuda, from the node) and the two libraries
# nothing links (libcaffe2_nvrtc: CUDA JIT, dlopen'ed on GPUs; libgfortran: unused).
missing="$(find "$site/torch" -name '*.so*' -type f ! -name 'libcaffe2_nvrtc.so' ! -name 'libgfortran.so*' \
  -exec sh -c 'LD_LIBRARY_PATH="$1" ldd "$2" 2>/dev/null | grep "not found"' _ "$lib_path" {} \; \
  | grep -v 'libcuda\.so' | sort -u)" || true
if [ -n "$missing" ]; then echo "torch-cpu: torch needs libraries not installed:" >&2; echo "$missing" >&2; exit 1; fi
echo "torch-cpu: torch's libraries load $(grep -c /nvidia/ "$keep") files of the nvidia packages" >&2
removed=0
find "$site/nvidia" \( -type f -o -type l \) | while read -r f; do
  case "$f" in
    */__init__.py|*.dist-info/*) continue ;;
  esac
  if ! grep -qxF "$(readlink -f "$f")" "$keep"; then rm -f "$f"; fi
done
find "$site/nvidia" -type d -empty -delete
rm -rf "$site/torch/include" "$site/torch/share" "$site/torch/test" "$site/torch/testing/_internal/opinfo" 2>/dev/null || true
"$py" - <<'PY'
import torch, torch.distributed as dist
assert not torch.cuda.is_available()
a = torch.randn(64, 64)
assert torch.allclose(a @ torch.eye(64), a)
assert dist.is_gloo_available()
print("torch", torch.__version__, "imports on CPU without the unused CUDA parts")
PY
