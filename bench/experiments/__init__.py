"""One-off experiments, each producing a section of docs/RESULTS.md (its docstring says which)."""
