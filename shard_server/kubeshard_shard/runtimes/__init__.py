"""Engines other than kubeshard's own, behind the same gRPC contract and router.

- ``onnx_engine``, ``onnx_model``: ONNX Runtime GenAI inside the shard server
  (``serve-shard --runtime onnx``);
- ``peers``: peer engines with an OpenAI-compatible HTTP API (vLLM, llama.cpp's server),
  each in its own environment under ``$KUBESHARD_CACHE/engines`` (``hack/engines.sh``),
  run beside ``kubeshard engine-info`` (``server/engine_info.py``).
"""
