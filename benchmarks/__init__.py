"""Benchmarks of pytreeckpt side by side with the tools a user would pick instead."""
