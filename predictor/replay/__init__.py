"""Trace replay: drive the real store and policies over request traces on a simulated clock."""
