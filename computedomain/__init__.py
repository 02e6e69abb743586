"""ComputeDomain service: API models, controller, DRA kubelet plugin and the Kubernetes I/O layer."""
