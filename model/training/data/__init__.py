"""Readers and example builders: Wikipedia -> NSP pairs -> masked batches; task data sets."""
