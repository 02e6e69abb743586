"""The per-domain NetworkPolicy of the IMEX daemons, as a pure builder (SPEC section 2: peer port 50000,
command service 50005).

``computedomain-daemon-<cdUID>`` in the driver namespace selects the domain's daemon pods (the CD label the
DaemonSet puts on them) and admits one thing: TCP to the IMEX peer port from pods with the same label, i.e.
the same domain's daemons. Nothing else reaches any port of a daemon pod, the command service included;
`nvidia-imex-ctl` in the daemon's probe runs inside the pod, and a pod is never blocked from itself. Egress is
left alone (the daemons dial their peers and the apiserver). A NetworkPolicy is enforced only by a network
plugin that implements it; without one it changes nothing.

No finalizer: nothing has to happen before it goes; teardown deletes it with the DaemonSet.
"""

from __future__ import annotations

from typing import Any

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL, IMEX_PEER_PORT
from computedomain.api.models import ComputeDomain
from computedomain.controller.claim_templates import daemon_object_name
from computedomain.settings import ControllerSettings


def network_policy(cd: ComputeDomain, settings: ControllerSettings) -> dict[str, Any]:
    same_domain = {"matchLabels": {COMPUTE_DOMAIN_LABEL: cd.uid}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": daemon_object_name(cd.uid),
            "namespace": settings.namespace,
            "labels": {COMPUTE_DOMAIN_LABEL: cd.uid},
        },
        "spec": {
            "podSelector": same_domain,
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": same_domain}], "ports": [{"protocol": "TCP", "port": IMEX_PEER_PORT}]}
            ],
        },
    }
