"""The result records the use cases return: frozen dataclasses with int bytes, None where unknown.

They import nothing from ``render`` and nothing from the use cases: a renderer registers itself
for a record type (``shown.renders``) and the record's ``str``/IPython display looks it up.
"""
