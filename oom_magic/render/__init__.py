"""Text and HTML for the records; importing this package registers every renderer (records/shown.py)."""
from . import guard  # noqa: F401  (registers the guard and diagnosis records)
