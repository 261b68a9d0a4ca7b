"""kubeshard router: a TGI- and OpenAI-compatible HTTP/SSE front for shard-group leaders.

Modules, one job each:

- ``config``      the typed router configuration, built once by ``cli``
- ``validation``  TGI/OpenAI request models and TGI's parameter rules
- ``tokenization`` the per-model tokenizer and chat template (from the leader's Info)
- ``backends/``   replica sources (static, Kubernetes), gRPC clients, the model registry
- ``balancer``    prefix-aware consistent hashing with bounded load
- ``admission``   per-model in-flight limit and bounded queue (429 + Retry-After)
- ``activation``  hold requests for a model with zero ready replicas; scale-up hook
- ``dispatch``    one generation: admission, replica choice, retries, cancellation
- ``cache``       Redis response cache for deterministic requests
- ``counters``    per-model in-flight/queued counts in Redis for autoscaling
- ``ratelimit``   per-key requests/tokens per minute (one Lua script per check)
- ``auth``        API keys from a file or a Kubernetes Secret
- ``tgi_api``, ``openai_api``, ``sse``, ``metrics``, ``app``, ``cli``
"""

__version__ = "0.1.0"
