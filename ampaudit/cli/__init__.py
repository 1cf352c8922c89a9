"""The ``ampaudit`` command line. Imports nothing heavy at module level."""
