"""hf_apex's own ops: a causal LM's loss without its logits (lm_loss)."""
