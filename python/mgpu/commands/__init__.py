"""The command line: main (the parser and one-line errors on every rank), one module per
command, and their shared helpers (common). Nothing below imports it."""
