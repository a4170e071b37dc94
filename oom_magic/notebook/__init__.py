"""The IPython glue: the magics, loading and unloading the extension, the after-cell watch and the
memory widget. The only package that imports IPython or ipywidgets.
"""
