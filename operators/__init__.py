"""The operator catalogue: one module per operator family (reference, cases, candidates)."""
