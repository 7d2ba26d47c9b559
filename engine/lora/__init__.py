"""LoRA adapters served on one base model: peft's files read and checked, the projections that
add each token's adapter, the adapter slots a step may use, and the registry of served names."""
