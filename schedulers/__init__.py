"""Scheduler plugins (imported as `flowmoe.schedulers`): one scheduler per module, a registry by name."""
