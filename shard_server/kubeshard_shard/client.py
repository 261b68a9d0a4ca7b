"""``kubeshard generate``: a small gRPC client for quick checks against a leader."""

from __future__ import annotations

import sys
import uuid

import grpc

from kubeshard_proto import pb, pb_grpc


def build_request(prompt: str, max_new_tokens: int, temperature: float | None = None, top_k: int | None = None,
                  top_p: float | None = None, seed: int | None = None, stop: list[str] | None = None,
                  ignore_eos: bool = False) -> pb.GenerateRequest:
    sampling = pb.SamplingParameters(do_sample=any(v is not None for v in (temperature, top_k, top_p, seed)))
    for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seed", seed)):
        if value is not None:
            setattr(sampling, name, value)
    return pb.GenerateRequest(
        request_id=uuid.uuid4().hex, inputs=prompt, sampling=sampling,
        stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens, stop_sequences=stop or [],
                                     ignore_eos=ignore_eos))


def run_generate(args) -> int:
    request = build_request(args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed,
                            args.stop, args.ignore_eos)
    with grpc.insecure_channel(args.server) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        try:
            for token in stub.Generate(request, timeout=args.timeout):
                sys.stdout.write(token.text)
                sys.stdout.flush()
                if token.HasField("finish"):
                    f = token.finish
                    reason = pb.FinishReason.Name(f.reason).removeprefix("FINISH_REASON_").lower()
                    print(f"\n[{f.generated_tokens} tokens, finish: {reason}, prompt {f.prompt_tokens} tokens]",
                          file=sys.stderr)
        except grpc.RpcError as exc:
            print(f"\nkubeshard generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0
