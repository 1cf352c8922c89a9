"""Shared by every pillar: the findings model, the op catalog, rule metadata, configuration."""
