"""Text and HTML drawing of the records; importing this package registers every renderer (``records.shown``)."""
from . import advice, cell, diagnosis, fit, guard, html, job, json, plot, segments, text, units  # noqa: F401  (each registers at import)
