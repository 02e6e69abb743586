"""Test-support package: the local control plane, simulated nodes, and stand-ins for what cannot exist here."""
