"""Graphs of the user's model, shared by check and convert: tracing (fx, with a recorder
fallback) that stamps each node with the user's file:line and module path, and passes
over those graphs."""
