"""Render a Report: rich terminal, JSON, SARIF, GitHub annotations."""
