"""Futures: the store that submits, runs and finishes them (store), each model's seq_id order
(order), the long-poll and a restarted client's recovery (waits), the SDK's batched poll
(completions)."""
