"""Pure functions: tensors and traces in, plain view data (lists, dicts, bytes) out."""
