"""Contracts every plugin uses: specs, policy, task nodes and plans, the executor, the cost model.

Nothing here imports the engine, the CLI or a plugin."""
