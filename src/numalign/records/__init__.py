"""Drift records, what every comparison leaves: the record and its reading and writing
(``drift``), what any exception of a test becomes (``outcomes``, the one exception policy)
and the one grammar of the suites' test ids (``testids``)."""
