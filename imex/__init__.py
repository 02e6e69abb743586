"""Everything about IMEX and the host's hardware: discovery, the compute-domain daemon and the host-managed
readiness check. The IMEX simulator, a hardware stand-in, lives in the test bed
(``tests/testbed/imex_simulator``); the import contracts keep the product from importing it."""
