// The sandbox ("pause") program of the test bed's real nodes: a static binary that holds a pod's
// namespaces, reaps orphans and exits on SIGTERM/SIGINT; packed into an OCI image by tests/testbed/image.py.
module computedomain.invalid/testbin/pause

go 1.26.0
