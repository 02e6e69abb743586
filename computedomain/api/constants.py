"""Names shared with the reference driver and its Helm chart. Users' YAML and dashboards rely on them:
change none of them (SPEC section 2)."""

from typing import Final

DRIVER_NAME: Final = "compute-domain.nvidia.com"

API_GROUP: Final = "resource.nvidia.com"
API_VERSION: Final = "v1beta1"
GROUP_VERSION: Final = f"{API_GROUP}/{API_VERSION}"

# The same string is the CD label key (value: CD UID) and the finalizer.
COMPUTE_DOMAIN_LABEL: Final = "resource.nvidia.com/computeDomain"
COMPUTE_DOMAIN_FINALIZER: Final = COMPUTE_DOMAIN_LABEL
CLIQUE_LABEL: Final = "resource.nvidia.com/computeDomain.cliqueID"
TEMPLATE_TARGET_LABEL: Final = "resource.nvidia.com/computeDomainTarget"
TEMPLATE_TARGET_DAEMON: Final = "Daemon"
TEMPLATE_TARGET_WORKLOAD: Final = "Workload"

CHANNEL_DEVICE_CLASS: Final = "compute-domain-default-channel.nvidia.com"
DAEMON_DEVICE_CLASS: Final = "compute-domain-daemon.nvidia.com"
# Beyond the reference (IMEX_ISOLATION=channel only): every channel device of a node, not just channel-0.
# Under channel isolation a channel device is a place for one claim; which IMEX channel the container gets
# is its ComputeDomain's (design note 0012).
ISOLATED_CHANNEL_DEVICE_CLASS: Final = "compute-domain-channel.nvidia.com"
# Ours (IMEX_ISOLATION=domain, driverManaged): the ComputeDomain (UID) whose IMEX domain holds a node, as a
# string attribute of that node's channel devices; a domain's workload template selects only devices that
# carry no holder or its own (design note 0014).
HOLDER_ATTRIBUTE: Final = "domain"
# Never assigned under channel isolation: it is the channel every workload shares without it.
SHARED_IMEX_CHANNEL: Final = 0

DAEMON_TEMPLATE_PREFIX: Final = "computedomain-daemon-"

GPU_CLIQUE_NODE_LABEL: Final = "nvidia.com/gpu.clique"

IMEX_PEER_PORT: Final = 50000
IMEX_COMMAND_PORT: Final = 50005
MAX_NODES_PER_IMEX_DOMAIN: Final = 18
HEALTH_PORT: Final = 51515
# Ours: where the IMEX daemon wrapper answers its pod's probes (GET /ready on the pod IP).
DAEMON_CHECK_PORT: Final = 8080
DEFAULT_HOST_SOCKET_PATH: Final = "/etc/nvidia-imex/imex_ctrl.sock"
