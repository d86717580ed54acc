"""Comparisons over studies: what their trials support (statistics, verdicts, provenance)."""
