"""Training: a small, model-agnostic next-token trainer (minGPT's habit: it knows nothing about GPT)."""
