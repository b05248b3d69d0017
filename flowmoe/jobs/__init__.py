"""Offline generation: prompt files, batching, sampling, the generation loop and the resumable job log."""
