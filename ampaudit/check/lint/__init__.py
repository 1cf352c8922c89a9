"""Training-script lint: AMP protocol bugs found in source with libcst, with autofixes."""
