"""Tensor math of an MoE decoder layer (imported as `flowmoe.kernels`).

Kernels import nothing of the project above them but the core specs."""
