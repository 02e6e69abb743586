"""The API's plain types and names, without pydantic: what a process that never decodes a model imports.

The IMEX daemon and its probe read and write their clique entries as raw JSON; importing pydantic and
building the models would cost each of them about 10 MiB and a tenth of a second at every start.
``computedomain.api.models`` re-exports everything here.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NewType

__all__ = ["AllocationMode", "CdUid", "CliqueId", "ConditionStatus", "NodeName", "ReadyStatus", "clique_name"]

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
