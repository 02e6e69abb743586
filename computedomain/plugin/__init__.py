"""The node agent: the DRA kubelet plugin of driver `compute-domain.nvidia.com` (design: docs/design/0007).

Kubernetes-independent building blocks: `grpc_server` (kubelet-facing sockets, on grpclib),
`preparer` (the version-free request/result contract), `checkpoint` (crash-safe node-local state),
`cdi` (per-claim CDI specs), `opaque` (which config applies to which allocated device), and Prepare itself,
one unit per job, read in this order: `collaborators`, `failures`, `claim_plan`, `side_effects`, `budget`,
`prepare` (its docstring is the map). The kubelet's wire contract (its `.proto` files and protobuf's modules
generated from them) lives in `proto/`; only `grpc_server` speaks it.

The agent around them: `claims`, `domains` (CD cache, watch-driven daemon readiness), `node_labels`,
`resourceslice`, `clique_label`, `cleanup`, and `app` (the process, `python -m computedomain kubelet-plugin`).
"""
