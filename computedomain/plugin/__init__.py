"""The node agent: the DRA kubelet plugin of driver `compute-domain.nvidia.com`.

Kubernetes-independent building blocks: `grpc_server` (kubelet-facing sockets, the only grpc user),
`preparer` (the version-free request/result contract), `checkpoint` (crash-safe node-local state),
`cdi` (per-claim CDI specs), `opaque` (which config applies to which allocated device), `atomic` (durable
file replacement). Generated protobuf modules live in `proto/`.
"""
