"""kubeshard router: a TGI- and OpenAI-compatible HTTP/SSE front for shard-group leaders.

Words: a *replica* is one shard group of a model, reached through its leader's address;
a *stream* is one response (SSE events, or the engine's token stream behind them); a
*flight* is one generation on one replica (a request retried elsewhere has several).
Several router instances may serve the same models; Redis is what they share.

Modules, one job each:

- ``config``        the typed router configuration, built once by ``cli``
- ``app``           the FastAPI app factory; ``state`` wires the parts once per app
- ``intake``        the per-request steps every generation route shares: admit, then
                    stream or collect, then account (metrics, refunds, status counts)
- ``tgi_api``, ``tgi_schema``      TGI's routes; its request models and parameter rules
- ``openai_api``, ``openai_schema``, ``openai_render``
                    OpenAI's routes; its request models and rules; its response shapes
- ``validation``    body parsing, ``Limits`` and the budget checks both APIs share
- ``engine_request`` the API-neutral request sent to a leader (and the cache key's source)
- ``tokenization``  the per-model tokenizer and chat template (from the leader's Info)
- ``backends/``     replica sources (static, Kubernetes), gRPC clients, models and
                    replicas (``model``), the registry and its probes; ``engine``: the one
                    interface generations go through, with two kinds, the gRPC contract
                    (``grpc_client``) and OpenAI-compatible HTTP engines (``openai_http``,
                    each engine's ``dialects``: vLLM, llama.cpp's server)
- ``generation``    the response cache in front of the dispatcher; per-request metrics
- ``dispatch``      one generation: activation, admission, replica choice, retries, and
                    one relay that reads a flight's tokens for ``stream`` and ``collect``
- ``flight``        one Generate call on one replica; the stall watchdog
- ``balancer``      prefix-aware consistent hashing with bounded load
- ``admission``     per-model in-flight limit and bounded queue (429 + Retry-After)
- ``activation``    hold requests for a model with zero ready replicas; scale-up hook
- ``cache``         Redis response cache for deterministic requests
- ``counters``      per-model in-flight/queued counts in Redis for autoscaling
- ``load``          a model's live load in this router instance (tokens in flight, tokens/s)
- ``load_api``      ``GET /internal/load``: that load, asked directly when Redis is away
- ``ratelimit``     per-key requests/tokens per minute (one Lua script per check)
- ``auth``          API keys from a file or a Kubernetes Secret
- ``tools``         tool calls: rendered by the chat template, enforced by the grammar, parsed back
- ``playground``    ``GET /``: the chat page (``playground.html``) over ``/v1/chat/completions``
- ``redis_store``   the Redis connection: short timeouts and a circuit breaker
- ``errors``, ``http``, ``sse``, ``metrics``, ``cli``
"""

__version__ = "0.1.0"
