"""The bottom layer, imported by every other: the findings model, the op catalog, rule
metadata and registry, configuration and finalize, the low-precision dtype, errors, atomic
files and the console. Nothing here imports another ampaudit layer (docs/design.md)."""
