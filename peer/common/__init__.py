"""Helpers every layer of hlbp.peer may use: the user-facing error type and atomic file writes.

Imports nothing of hlbp but ``hlbp.protocol``.
"""
