"""Root conftest: nothing downloads, and each process uses the cores it is given."""

import os

# Tests and suites never fetch weights: models come from local folders or golden/models/.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
