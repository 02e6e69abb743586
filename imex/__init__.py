"""Everything about IMEX and the host's hardware: discovery, the compute-domain daemon, the host-managed
readiness check, and the IMEX simulator used by the test bed."""
