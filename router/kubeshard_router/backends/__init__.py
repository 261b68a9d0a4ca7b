"""Where replicas come from (static list, Kubernetes) and how the router talks to them."""
