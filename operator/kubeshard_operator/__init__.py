"""kubeshard operator: reconciles InferenceService objects into sharded StatefulSet groups.

Words: a *group* is one StatefulSet of `shards` pods (one process per shard, rank = pod
ordinal) and serves one *replica* of the model; spec.replicas counts groups. The
Kubernetes API group of the CRD is the *API group* (API_GROUP).

Layout (one concept per module):
  config.py     the operator's typed configuration (built once by the CLI)
  spec.py       the typed, validated InferenceService spec (built once from the CRD dict)
  naming.py     names and labels of every child object
  shard_pod.py  pure: spec -> the pod template of a group's shards
  engine_pod.py pure: spec -> the pod template of a group served by a peer engine (vLLM,
                llama.cpp's server, any OpenAI-compatible image) with engine-info beside it
  builders.py   pure functions: spec -> manifests (StatefulSet, Services, PDB, HPA)
  observe.py    one read of the children per pass: a Snapshot, and its groups as views
  rollout.py    pure group planning: scaling and surge rollouts, group restarts
  children.py   pure: spec, snapshot and plan -> the steps to apply and delete
  status.py     pure: what was observed and planned -> status (phase, conditions, replicas)
  kube.py       a small Kubernetes REST helper (server-side apply, list, delete)
  reconciler.py one reconcile pass: observe, plan, desired children, apply, report
  cleanup.py    the finalizer's Redis key removal
  load.py       the routers' live load of a model (Redis, else the router pods directly)
  idle.py       pure: when a model that may scale to zero is idle long enough
  handlers.py   thin kopf handlers
  cli.py        the `kubeshard-operator` entry point
  metrics_api.py      the custom metrics API (custom.metrics.k8s.io/v1beta2) on aiohttp
  delegated_auth.py   its delegated authentication and authorization
  metrics_server.py   `kubeshard-operator metrics-server`: that API's process
"""

API_GROUP = "kubeshard.io"
VERSION = "v1alpha1"
PLURAL = "inferenceservices"
KIND = "InferenceService"
API_VERSION = f"{API_GROUP}/{VERSION}"
__version__ = "0.1.0"
