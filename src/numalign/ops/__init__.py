"""The operator engine: the catalogue's registry of operators and candidates (``registry``;
the operators themselves live in the top-level ``operators`` package), the cases per tier
and their seeded inputs (``cases``), one case run and judged (``check``: truth in float64,
control, candidate, compare), the truth cache (``truths``), what a model needs from the
catalogue (``inventory``) and the checks' wall time per phase (``phases``). It never imports
``replay``."""
