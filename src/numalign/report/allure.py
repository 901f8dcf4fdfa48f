"""Allure glue: labels and attachments for each drift record, when allure-pytest is active
(``--alluredir``). Labels: epic = suite, feature = operator or model, story = dtype;
parameters: candidate, case, device. Failing records attach their metrics (JSON) and an
error histogram (PNG)."""

from __future__ import annotations

import io
from typing import Any

from numalign.core import finite_json
from numalign.records.drift import DriftRecord

#: Histogram image size in pixels.
_WIDTH, _HEIGHT = 560, 240


class Annotator:
    """Labels and attachments of one test's records (one per test: ``record_drift``). The
    labels come from the test's first record and are given once, whatever the number of its
    records: epic = suite, feature = operator or model, story = the dtype the test ran in
    (from its id; an int64 output of a bfloat16 test files under bfloat16). Every failing
    record attaches its metrics and error histogram; what the test's outcome is, xfail
    included, Allure takes from pytest, so its counts are pytest's."""

    def __init__(self) -> None:
        self.labelled = False
        self.parameters: set[str] = set()

    def __call__(self, record: DriftRecord) -> None:
        import allure

        if not self.labelled:
            self.labelled = True
            allure.dynamic.epic(str(record.suite))
            allure.dynamic.feature(record.group)
            allure.dynamic.story(str(record.test_dtype))
        for name in ("candidate", "case", "request", "device", "swap"):
            value = getattr(record, name)
            if value and name not in self.parameters:  # one value per parameter: the first
                self.parameters.add(name)
                allure.dynamic.parameter(name, str(value))
        if record.verdict in ("failed", "crashed", "error"):
            _attach(record)


def annotate(record: DriftRecord) -> None:
    """Labels one record on its own (a test with a single record); ``Annotator`` for a
    test's several."""
    Annotator()(record)


def _attach(record: DriftRecord) -> None:
    import allure

    point = record.point or "output"
    data = record.to_dict()
    allure.attach(
        finite_json.dumps({k: data[k] for k in ("point", "request", "rule", "reason",
                                                "budget_used", "budget", "detectable", "metrics")},
                          indent=2),
        name=f"{point} metrics",
        attachment_type=allure.attachment_type.JSON,
    )  # fmt: skip
    octaves = record.metrics.get("ulp_octaves") or []
    if octaves:
        allure.attach(
            histogram_png(octaves, title=f"{point}: error in ulps"),
            name=f"{point} error histogram",
            attachment_type=allure.attachment_type.PNG,
        )


def histogram_png(octaves: list[list[Any]], *, title: str) -> bytes:
    """A bar chart of how many elements fall in each octave of ulp error (log2 bins), with
    bar heights on a log scale so that a few outliers beside millions of exact values show."""
    import math

    from PIL import Image, ImageDraw

    bins = [(("0" if k is None else f"2^{k}"), int(n)) for k, n in octaves]
    image = Image.new("RGB", (_WIDTH, _HEIGHT), "white")
    draw = ImageDraw.Draw(image)
    draw.text((10, 6), f"{title} (elements per octave, log scale)", fill="black")
    left, bottom, top = 20, _HEIGHT - 30, 34
    peak = math.log10(max(n for _, n in bins) + 1)
    width = (_WIDTH - left - 10) / max(1, len(bins))
    label_every = max(1, math.ceil(len(bins) * 40 / (_WIDTH - left)))
    for i, (label, count) in enumerate(bins):
        x0 = left + i * width
        height = (bottom - top) * math.log10(count + 1) / peak
        draw.rectangle([x0 + 1, bottom - height, x0 + max(2.0, width - 2), bottom], fill="#1f77b4")
        if i % label_every == 0:
            draw.text((x0, bottom + 4), label, fill="black")
            if width * label_every >= 36:
                draw.text((x0, bottom - height - 12), str(count), fill="#333333")
    draw.line([left, bottom, _WIDTH - 10, bottom], fill="black")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
