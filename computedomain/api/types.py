"""The API's plain types and names, without pydantic: what a process that never decodes a model imports.

The IMEX daemon and its probe read and write their clique entries as raw JSON; importing pydantic and
building the models would cost each of them about 10 MiB and a tenth of a second at every start.
``computedomain.api.models`` re-exports everything here.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Final, NewType

__all__ = [
    "INDEX_LOCK_PREFIX",
    "AllocationMode",
    "CdUid",
    "CliqueId",
    "ConditionStatus",
    "NodeName",
    "ReadyStatus",
    "clique_name",
    "index_lock",
    "index_locks",
]

CdUid = NewType("CdUid", str)
NodeName = NewType("NodeName", str)
CliqueId = NewType("CliqueId", str)


class AllocationMode(StrEnum):
    SINGLE = "Single"
    ALL = "All"


class ReadyStatus(StrEnum):
    """Used for the domain as a whole and for each daemon entry."""

    READY = "Ready"
    NOT_READY = "NotReady"


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


def clique_name(cd_uid: str, clique_id: str) -> str:
    """`<cdUID>.<cliqueID>`: the ComputeDomainClique of one domain and one NVLink clique."""
    return f"{cd_uid}.{clique_id}"


#: ``<INDEX_LOCK_PREFIX><index>`` is the ComputeDomainClique annotation that names the node holding a slot
#: (imex.daemon.registration explains the protocol; the controller drops the locks of entries it prunes).
INDEX_LOCK_PREFIX: Final = "resource.nvidia.com/index-"


def index_lock(index: int) -> str:
    return f"{INDEX_LOCK_PREFIX}{index}"


def index_locks(annotations: Any) -> dict[int, str]:
    """index -> node name of every slot lock among ``annotations`` (anything else is ignored)."""
    out: dict[int, str] = {}
    if not isinstance(annotations, Mapping):
        return out
    for key, value in annotations.items():
        if isinstance(key, str) and key.startswith(INDEX_LOCK_PREFIX) and isinstance(value, str):
            suffix = key[len(INDEX_LOCK_PREFIX) :]
            if suffix.isdigit() and len(suffix) <= 4:
                out[int(suffix)] = value
    return out
