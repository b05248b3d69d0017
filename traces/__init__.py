"""Spans, Chrome trace writing and trace analysis (imported as `flowmoe.traces`)."""
