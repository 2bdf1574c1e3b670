"""Jobs: the Redis job store, job documents, stage messages and cancellation."""
