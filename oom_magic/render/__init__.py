"""Text and HTML drawing of the records; importing this package registers every renderer (``records.shown``)."""
from . import cell, fit, html, json, plot, segments, text, units  # noqa: F401  (each registers at import)
