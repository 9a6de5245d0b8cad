"""Timing programs (not part of the installed package): ``benchmarks.attention`` and ``benchmarks.plot``."""
