"""Graphs of the user's model, shared by check and convert: tracing (fx, with a recorder
fallback) that stamps each node with the user's file:line and module path, the view every
pass reads (``view.GraphView``), and the passes shared by check's rules and convert's plan
(dtype flow, patterns, constants, value ranges)."""
