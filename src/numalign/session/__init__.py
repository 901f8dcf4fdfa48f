"""A numalign session's settings, below the pytest plugin (``numalign.plugin``) and the
command line: option values' names, defaults and parsers (``option_values``, torch-free),
the one option table (``options``), the frozen ``Settings`` read through it (``settings``)
and the guard that fails a session whose tests all skipped (``selection``)."""
