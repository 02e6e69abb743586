"""The external contracts: names, labels and the typed ComputeDomain API (SPEC section 2)."""
