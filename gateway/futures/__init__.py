"""Futures: the store that submits, runs and finishes them (store), each model's seq_id order
(order), the long-poll (waits), the SDK's batched poll over the database (completions)."""
