"""Text and HTML drawing of the records; importing the package registers every renderer (``records.shown``)."""
from . import fit  # noqa: F401  (registers Preflight and Lint)
