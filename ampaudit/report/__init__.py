"""Renderers on top of the pillars: a check Report as rich text, JSON, SARIF or GitHub
annotations; rule docs; convert's summary; watch plots and TensorBoard scalars."""
