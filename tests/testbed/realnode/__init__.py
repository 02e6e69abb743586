"""Real nodes for the test bed: a real kubelet and containerd (runc, CNI, CDI) per node, next to the kwok nodes.

    python -m tests.testbed.realnode up [--nodes 2]   start them on the running local cluster
    python -m tests.testbed.realnode down             stop them and remove every trace
    python -m tests.testbed.realnode status           nodes, processes and memory

`nodes.RealNodes` does the work; `netd` links the nodes to the control plane; `driverroot` lays out each
node's fake NVIDIA driver root. docs/design/0009-real-nodes.md explains the layout and what never touches the
machine.
"""
