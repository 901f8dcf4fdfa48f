"""What every other package stands on, importing nothing of numalign and not torch: the
exception kinds (``errors``), the dtype names and their one conversion to torch
(``dtypes``), suggestions for mistyped names (``names``) and the JSON every record and
report is written in (``finite_json``)."""
