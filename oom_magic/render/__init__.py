"""Text and HTML for the records; importing this package registers every renderer (records/shown.py)."""
from . import advice, diagnosis, guard  # noqa: F401  (each registers its records' renderers at import)
