"""A SIMULATED cluster of GB200 NVL72 racks for tests, benchmarks and `make demo` (test support, not product).

Nothing here can exist outside a test bed: there are no GPUs, no NVLink, no container runtime and no kubelet.
What is real: the control plane (tests/testbed/cluster.py), the chart as `helm install` renders it, and the
processes of this service, run with the identity, env and arguments of the pods the chart and the controller
create. What is simulated, and where:

- `topology`: NVL72 racks (18 compute trays = one clique each) plus non-fabric nodes as kwok Nodes, each with
  its own directory tree standing in for its root filesystem (kubelet dirs, CDI dir, fake driver `/proc`),
  its own loopback network `127.A.B.0/25` (`spec.podCIDR`, so kwok hands out pod IPs the IMEX simulator can
  bind) and host IP `127.A.B.200`;
- `pods`: the kubelet's container side: runs a pod's container as a process (or hosted in a shared process
  on large topologies, see `podhost`), with the pod's env (downward API resolved), a service account
  (TokenRequest token bound to the pod, CA) where a pod's in-cluster loader reads it, mount paths
  translated into the node's tree, CDI edits of its prepared claims applied, probes, restarts, and the IMEX
  simulator as `nvidia-imex`;
- `hostimex`: hostManaged mode's per-node host IMEX service (the simulator on a unix socket under the node's
  driver root, reachable by a chrooted `nvidia-imex-ctl`);
- `cluster.SimCluster`: puts it together (own kwok, kubelet stand-ins, pod runner, `helm install`).

docs/design/0008-simulated-cluster.md explains the choices.
"""
