"""Triage tools on top of the model: caching, interventions, component swaps, comparisons."""
