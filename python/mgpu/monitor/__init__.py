"""Device telemetry (sampler, series, plots) and the safety rules that stress and
train --telemetry share. Imports only the bottom."""
