"""SafeBits: safety-constrained global bit budgeting with error feedback for Horovod."""
