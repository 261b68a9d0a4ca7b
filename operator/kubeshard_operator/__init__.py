"""kubeshard operator: reconciles InferenceService objects into sharded StatefulSet groups.

Layout (one concept per module):
  spec.py       the typed, validated InferenceService spec (built once from the CRD dict)
  naming.py     names and labels of every child object
  builders.py   pure functions: spec -> manifests (StatefulSet, Services, PDB, HPA)
  rollout.py    pure group planning: scaling and surge rollouts, group restarts
  status.py     pure: children -> status (phase, conditions, replicas)
  kube.py       a small Kubernetes REST helper (server-side apply, list, delete)
  reconciler.py one reconcile pass over the cluster, built from the pieces above
  cleanup.py    the finalizer's Redis key removal
  handlers.py   thin kopf handlers
  cli.py        the `kubeshard-operator` entry point
"""

API_GROUP = "kubeshard.io"
VERSION = "v1alpha1"
PLURAL = "inferenceservices"
KIND = "InferenceService"
API_VERSION = f"{API_GROUP}/{VERSION}"
__version__ = "0.1.0"
