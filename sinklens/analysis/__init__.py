"""Streaming analyzers of attention sinks and their causes."""
