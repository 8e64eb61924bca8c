"""Reads of the lowered graphs: the simulated step behind ``program.report`` (time and memory
per node) and the check that every rank issues the same collectives in the same order."""
