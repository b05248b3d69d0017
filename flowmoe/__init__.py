"""flowmoe: a dataflow runtime for Mixture-of-Experts inference with offloaded experts."""

__version__ = "0.1.0"
