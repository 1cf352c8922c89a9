"""What every training-script rule reads: one ``ast`` parse and visit (collect.py, visit.py)
into read-only facts (facts.py), the AMP protocol helpers over them (protocol.py), literal
values, and the edits autofixes are made of. The rules live in check/script_rules/;
check/lint_file.py runs them on a file."""
