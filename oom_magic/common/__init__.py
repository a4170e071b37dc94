"""What every layer shares: the one error type, user-typed sizes, dtype names and widths, and torch
only when the user has imported it. Nothing here reads the machine or a file.
"""
