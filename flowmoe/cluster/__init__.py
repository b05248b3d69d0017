"""One resumable job over many replicas with Ray: each replica a full flowmoe runtime (model and
scheduler) on its own GPU or CPU slice; the driver alone writes the job's output log."""
