"""Workers that execute task nodes (imported as `flowmoe.devices`): thread pool, CUDA streams, simulator."""
