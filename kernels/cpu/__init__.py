"""The C kernel that attends decode rows on the CPU, its loader and its private build cache."""
