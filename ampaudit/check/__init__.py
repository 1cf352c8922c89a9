"""Pillar 1, ``ampaudit check``: audit a model (and, later, a training script) before AMP."""
