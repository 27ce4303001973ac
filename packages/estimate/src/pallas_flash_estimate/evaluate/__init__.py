"""Evaluating a listing: which bundles and ops run, and how often."""
